"""Chat templates: transformers-style rendering and assistant-only loss masks."""
import json

import numpy as np
import pytest
import tokenizers

from kdjax import cache, tokenizer
from kdjax.data import chat, packing, sources, stage

# Llama-3-Instruct's template, verbatim.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
    "<|end_header_id|>\n\n' }}{% endif %}")

# Qwen2.5-Instruct's template without the tool branches (whitespace control as in the original).
QWEN = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant") %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "tool" %}
        {{- raise_exception('tool messages are not supported here') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Like Qwen3: the last assistant turn gets an (empty) thinking block, earlier ones do not, so a
# prefix of the conversation does not render as a prefix of the whole.
REWRITING = """{%- for message in messages %}
{%- if message.role == 'assistant' and loop.last %}
{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + message.content + '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# The harmony format of gpt-oss (o200k_harmony), written for this test: a system header, then
# each turn as <|start|>role<|message|>...<|end|>; assistant answers on the final channel, the last
# one (training) closed by <|return|>, earlier ones by <|end|>: a rewriting template.
HARMONY = """{{- '<|start|>system<|message|>Reasoning: medium<|end|>' }}
{%- for message in messages %}
{%- if message.role == 'assistant' %}
{{- '<|start|>assistant<|channel|>final<|message|>' + message.content }}
{{- '<|return|>' if loop.last and not add_generation_prompt else '<|end|>' }}
{%- else %}
{{- '<|start|>' + message.role + '<|message|>' + message.content + '<|end|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}
"""

# The Llama-3 template with transformers' {% generation %} markers around assistant output.
LLAMA3_GENERATION = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}{% else %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}")

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Add 2 and 2."},
    {"role": "assistant", "content": "4, of course."},
]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def base_tokenizer(tmp_path_factory):
  texts = [d.text for d in sources.documents("stdlib", max_bytes=200_000)]
  return tokenizer.train_bpe(texts, 400, str(tmp_path_factory.mktemp("t") / "tokenizer.json"))


def checkpoint(tmp_path, base, specials, config) -> tokenizer.Tokenizer:
  hf = tokenizers.Tokenizer.from_str(base.hf.to_str())
  hf.add_special_tokens(specials)
  hf.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
  return tokenizer.load(str(tmp_path))


def renderer(template, assistant_only=True, bos="<|begin_of_text|>", eos="<|eot_id|>"):
  return chat.Renderer(template, bos_token=bos, eos_token=eos, assistant_only=assistant_only)


def test_llama3_render_matches_transformers_output():
  text, spans = renderer(LLAMA3).render(CONVERSATION)
  assert text == (
      "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
      "<|start_header_id|>user<|end_header_id|>\n\nAdd 2 and 2.<|eot_id|>"
      "<|start_header_id|>assistant<|end_header_id|>\n\n4, of course.<|eot_id|>")
  # Assistant turns: content and end-of-turn, never the role header.
  assert [text[a:b] for a, b in spans] == ["Hello!<|eot_id|>", "4, of course.<|eot_id|>"]


def test_qwen_render_and_spans():
  text, spans = renderer(QWEN, bos=None, eos="<|im_end|>").render(CONVERSATION[1:])
  assert text.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
  assert text.endswith("<|im_start|>assistant\n4, of course.<|im_end|>\n")
  # The newline the template writes after <|im_end|> is not the model's to generate.
  assert [text[a:b] for a, b in spans] == ["Hello!<|im_end|>", "4, of course.<|im_end|>"]


def test_generation_blocks_agree_with_prefix_rendering():
  text_g, spans_g = renderer(LLAMA3_GENERATION).render(CONVERSATION)
  text_p, spans_p = renderer(LLAMA3).render(CONVERSATION)
  assert text_g == text_p and spans_g == spans_p
  assert renderer(LLAMA3_GENERATION, assistant_only=False).render(CONVERSATION) == (text_p, None)


def test_rewriting_template_fails_loudly():
  with pytest.raises(chat.ChatTemplateError, match="generation"):
    renderer(REWRITING).render(CONVERSATION[1:])
  text, spans = renderer(REWRITING, assistant_only=False).render(CONVERSATION[1:])
  assert "<think>" in text and spans is None


def test_harmony_format():
  """gpt-oss's harmony: one answer (prompt/response data) is located by prefix rendering, the
  span its channel header, text and <|return|>; several answers (each but the last rewritten
  with <|end|>) fail loudly for loss_mask='assistant' and render whole for 'all'."""
  single = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]
  text, spans = renderer(HARMONY).render(single)
  assert text == ("<|start|>system<|message|>Reasoning: medium<|end|><|start|>user<|message|>2+2?"
                  "<|end|><|start|>assistant<|channel|>final<|message|>4.<|return|>")
  assert [text[a:b] for a, b in spans] == ["<|channel|>final<|message|>4.<|return|>"]
  with pytest.raises(chat.ChatTemplateError, match="generation"):
    renderer(HARMONY).render(CONVERSATION[1:])
  text, spans = renderer(HARMONY, assistant_only=False).render(CONVERSATION[1:])
  assert "final<|message|>Hello!<|end|>" in text and text.endswith("course.<|return|>")
  assert spans is None


def test_assistant_only_loss_mask_end_to_end(base_tokenizer, tmp_path):
  tok = checkpoint(tmp_path, base_tokenizer, LLAMA_SPECIALS,
                   {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                    "chat_template": LLAMA3})
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
  docs = list(sources.documents(str(path), chat_template=tok.chat_template,
                                bos_token=tok.bos_token, eos_token=tok.eos_token,
                                loss_mask="assistant"))
  assert docs[0].templated
  (ids, targets), = stage.tokenize(docs, tok)
  assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id  # written by the template, as tokens
  packer = packing.Packer(128, bos_id=tok.bos_id, eos_id=tok.eos_id)
  assert packer.push((ids, targets), add_specials=False) == []
  (row,) = packer.close()
  predicted = row["tokens"][1:][row["loss_mask"][:-1]]
  assert tok.decode(predicted) == "Hello!<|eot_id|>4, of course.<|eot_id|>"


def test_qwen_checkpoint_all_tokens_mask(base_tokenizer, tmp_path):
  tok = checkpoint(tmp_path, base_tokenizer, QWEN_SPECIALS,
                   {"bos_token": None, "eos_token": "<|im_end|>", "chat_template": QWEN})
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
  (doc,) = sources.documents(str(path), chat_template=tok.chat_template, bos_token=None,
                             eos_token=tok.eos_token, loss_mask="all")
  (ids, targets), = stage.tokenize([doc], tok)
  assert doc.spans is None and targets.all()
  assert tok.decode(ids) == doc.text
  assert (ids == tok.hf.token_to_id("<|im_start|>")).sum() == len(CONVERSATION)


def test_failing_template_names_the_document(tmp_path):
  path = tmp_path / "chat.jsonl"
  bad = [{"role": "user", "content": "x"}, {"role": "tool", "content": "{}"}]
  lines = [{"messages": CONVERSATION[1:3]}, {"messages": bad}]
  path.write_text("".join(json.dumps(r) + "\n" for r in lines))
  docs = sources.documents(str(path), chat_template=QWEN, eos_token="<|im_end|>")
  next(docs)
  with pytest.raises(sources.DataError, match=r"line 2 \(document 1\).*tool messages"):
    next(docs)


def test_bad_messages_and_syntax_errors():
  with pytest.raises(chat.ChatTemplateError, match="message 0"):
    renderer(LLAMA3).render([{"role": "user"}])
  with pytest.raises(chat.ChatTemplateError, match="does not compile"):
    renderer("{% for m in messages %}")


def test_chat_records_need_a_template(tmp_path):
  path = tmp_path / "chat.jsonl"
  path.write_text(json.dumps({"messages": CONVERSATION}) + "\n")
  with pytest.raises(sources.DataError, match="no chat template"):
    list(sources.documents(str(path)))


def test_offsets_map_spans_to_tokens(base_tokenizer):
  # Multi-byte characters inside and around a span: targets follow characters, not bytes.
  doc = sources.Document("é→x ✓✓ done", spans=((2, 6),))
  (ids, targets), = stage.tokenize([doc], base_tokenizer)
  enc = base_tokenizer.hf.encode(doc.text, add_special_tokens=False)
  for (a, b), t in zip(enc.offsets, targets):
    assert t == (a < 6 and b > 2)
  assert targets.any() and not targets.all()
  np.testing.assert_array_equal(ids, enc.ids)


def test_generation_marks_edge_cases():
  r = renderer(LLAMA3_GENERATION)
  text, spans = r.render(CONVERSATION[:2])
  assert spans == () and "\ue000" not in text
  with pytest.raises(chat.ChatTemplateError, match="U\\+E000"):
    r.render([{"role": "user", "content": "odd \ue000 char"}])


def test_conversation_without_assistant_turn_is_skipped(base_tokenizer, tmp_path):
  tok = checkpoint(tmp_path, base_tokenizer, LLAMA_SPECIALS,
                   {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                    "chat_template": LLAMA3})
  path = tmp_path / "chat.jsonl"
  records = [{"messages": CONVERSATION}] * 2 + [{"messages": CONVERSATION[:2]}] * 2
  path.write_text("".join(json.dumps(r) + "\n" for r in records))
  counts = stage.build_stores(str(path), tok, 64, str(tmp_path / "tr"), str(tmp_path / "ev"),
                              eval_every=2, loss_mask="assistant")
  assert counts["docs"] == 4 and counts["no_targets"] == 2
  assert counts["train_tokens"] == counts["eval_tokens"] > 0  # one full conversation each


def test_smollm2_assistant_targets(smollm2_tokenizer, tmp_path):
  """SmolLM2-Instruct (transformers 5 layout: the template in chat_template.jinja), through the
  data stage: the targets are each answer's tokens from its first through <|im_end|>; the role
  header "<|im_start|>assistant\\n" and the newline after <|im_end|> are not. The header's
  newline is a loss position: it predicts the answer's first token."""
  tok = tokenizer.load(smollm2_tokenizer(tmp_path / "smollm2"))
  conversation = [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello there!"},
                  {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."}]
  path = tmp_path / "chat.jsonl"
  path.write_text((json.dumps({"messages": conversation}) + "\n") * 2)
  stage.build_stores(str(path), tok, 128, str(tmp_path / "tr"), str(tmp_path / "ev"),
                     eval_every=2, loss_mask="assistant")
  row = cache.open(str(tmp_path / "tr")).read(slice(0, 1))
  tokens, mask = row["tokens"][0], row["loss_mask"][0]
  assert tok.decode(tokens[1:][mask[:-1]]) == "Hello there!<|im_end|>4.<|im_end|>"
  text = tok.decode(tokens[row["segment_ids"][0] == 1])
  assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
  assert text.endswith("<|im_start|>assistant\n4.<|im_end|>\n")  # as the template wrote it
  header = tok.encode("<|im_start|>assistant\n")
  first = len(tok.encode(text[:text.index("Hello there!")]))
  assert list(tokens[first - len(header):first]) == header and mask[first - 1]
  assert "Hello there!".startswith(tok.decode(tokens[first:first + 1]))
  assert not mask[first - 2]  # "assistant" does not predict the newline
