"""Chat templates rendered as Hugging Face transformers renders them, with assistant spans.

The template is the jinja2 string of a tokenizer_config.json, compiled in a sandboxed environment
with trim_blocks/lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`, and the variables
`messages`, `bos_token`, `eos_token`, `tools=None`, `documents=None`, `add_generation_prompt`.

Assistant spans (the characters whose tokens are targets with loss_mask="assistant") are found:
  * exactly, from `{% generation %}...{% endgeneration %}` blocks when the template has them;
  * otherwise by rendering prefixes of the conversation: assistant turn i starts where
    render(messages[:i], add_generation_prompt=True) ends, so the role header with its trailing
    newline ("<|im_start|>assistant\n") is not a target and the first target is the answer's
    first token; it ends where render(messages[:i+1]) ends, less the whitespace the template
    writes after the turn, so the end-of-turn token (<|im_end|>, <|eot_id|>) is the last target
    (the model learns to stop) and the separator after it ("\n") is not. These are exactly the
    tokens the model generates at inference. Both renders must be prefixes of the whole
    conversation's render; a template that rewrites earlier turns (e.g. drops past reasoning)
    fails loudly rather than masking the wrong characters.

Targets are tokens; the stores' loss_mask marks the position BEFORE each target (position t
predicts token t+1, kdjax/data/packing.py), so the header's newline, which predicts the answer's
first token, has loss_mask True while not being a target itself.
"""
import datetime
import json
import re

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2 import nodes

from kdjax.errors import UserError

# Private-use code points bracketing {% generation %} output; removed after rendering.
_OPEN, _CLOSE = "\ue000", "\ue001"
_MARKS = re.compile(f"([{_OPEN}{_CLOSE}])")


class ChatTemplateError(UserError):
  """The template failed or cannot locate assistant turns; the message says why."""


class _GenerationTag(jinja2.ext.Extension):
  """transformers' `{% generation %}` block: marks assistant text for assistant-only masks."""
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

  def _mark(self, caller):
    return _OPEN + caller() + _CLOSE


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


def compile_template(template: str) -> jinja2.Template:
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[_GenerationTag, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  try:
    return env.from_string(template)
  except jinja2.TemplateSyntaxError as e:
    raise ChatTemplateError(f"chat template does not compile: {e} (line {e.lineno})") from e


class Renderer:
  """Renders conversations; with assistant_only, also returns the assistant character spans."""

  def __init__(self, template: str, *, bos_token: str | None, eos_token: str | None,
               assistant_only: bool):
    self.template = compile_template(template)
    self.marks = "endgeneration" in template
    self.bos_token = bos_token or ""
    self.eos_token = eos_token or ""
    self.assistant_only = assistant_only

  def _render(self, messages, add_generation_prompt=False) -> str:
    try:
      # tools/documents are passed as None, as transformers does: templates test
      # `tools is not none`, which an undefined variable would pass.
      return self.template.render(messages=messages, tools=None, documents=None,
                                  bos_token=self.bos_token, eos_token=self.eos_token,
                                  add_generation_prompt=add_generation_prompt)
    except jinja2.exceptions.TemplateError as e:
      raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    except (TypeError, KeyError, AttributeError, ValueError) as e:
      raise ChatTemplateError(f"chat template failed on these messages: "
                              f"{type(e).__name__}: {e}") from e

  def render(self, messages: list[dict]) -> tuple[str, tuple[tuple[int, int], ...] | None]:
    """Returns (text, spans); spans is None unless assistant_only."""
    _check_messages(messages)
    text = self._render(messages)
    if self.marks:
      if any(c in str(m["content"]) for m in messages for c in (_OPEN, _CLOSE)):
        raise ChatTemplateError("message content holds the private-use characters U+E000/U+E001 "
                                "that mark {% generation %} output")
      text, spans = _strip_marks(text)
      return text, spans if self.assistant_only else None
    if not self.assistant_only:
      return text, None
    return text, self._prefix_spans(messages, text)

  def _prefix_spans(self, messages, text) -> tuple[tuple[int, int], ...]:
    spans = []
    for i, message in enumerate(messages):
      if message["role"] != "assistant":
        continue
      try:
        before = self._render(messages[:i], add_generation_prompt=True)
      except ChatTemplateError:  # e.g. a template that reads messages[0] of an empty list
        before = None
      through = self._render(messages[:i + 1])
      if before is None or not text.startswith(before) or not text.startswith(through):
        raise ChatTemplateError(
            f"cannot locate assistant turn {i}: the template's render of the first turns is not "
            "a prefix of the whole conversation (add {% generation %} blocks to the template, "
            "or use data.loss_mask='all')")
      start, stop = len(before), len(through.rstrip())
      if start < stop:
        spans.append((start, stop))
    return tuple(spans)


def _check_messages(messages):
  if not isinstance(messages, list):
    raise ChatTemplateError(f"messages must be a list of {{role, content}}, got "
                            f"{type(messages).__name__}")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
      raise ChatTemplateError(f"message {i} is not a {{role, content}} object: {m!r:.200}")


def _strip_marks(marked: str) -> tuple[str, tuple[tuple[int, int], ...]]:
  out, spans, start, length = [], [], None, 0
  for piece in _MARKS.split(marked):
    if piece == _OPEN:
      start = length
    elif piece == _CLOSE:
      if start is not None and start < length:
        spans.append((start, length))
      start = None
    else:
      out.append(piece)
      length += len(piece)
  return "".join(out), tuple(spans)
