"""Text sampled from the teacher itself: the control where the teacher's distribution IS the data.

    python3 -m experiments.studies.sample_teacher --hf runs/smollm2/hf \
        --prompts runs/smollm2/corpus/train.jsonl --out runs/smollm2/corpus_sampled \
        --train-tokens 4000000 --eval-tokens 300000

Needs torch and transformers (the GPU image's python3, or kdjax's side venv on a CPU for a tiny
run). Each document is PROMPT_TOKENS tokens of a training document (a different one each time,
so samples cover code and verse) continued by the teacher with plain ancestral sampling: the
teacher's own softmax at temperature 1, no top-k, top-p or repetition penalty, cut after its
end-of-text token. Writes the token ids as sampled, never decoded and tokenised again (which
would rewrite non-canonical splits and make the text no longer the teacher's samples):
OUT/train.jsonl and OUT/eval.jsonl (pre-tokenised records {"input_ids": [...], "loss_mask":
[...]}, the prompt's ids not targets, the data stage packs them as they are) and
OUT/manifest.json. Resumable: finished batches are appended to OUT/*.partial and counted.
"""
import argparse
import json
import os
import time

PROMPT_TOKENS = 8  # real tokens that start each sample; everything after is the teacher's


def prompts(path: str, tokenizer, count: int, skip: int) -> list[list[int]]:
  """The first PROMPT_TOKENS tokens of documents skip.. of a jsonl file (long enough ones)."""
  out = []
  with open(path) as f:
    for i, line in enumerate(f):
      if i < skip:
        continue
      ids = tokenizer(json.loads(line)["text"][:400])["input_ids"][:PROMPT_TOKENS]
      if len(ids) == PROMPT_TOKENS:
        out.append(ids)
      if len(out) == count:
        break
  if len(out) < count:
    raise SystemExit(f"{path}: only {len(out)} documents to prompt with, {count} needed")
  return out


def sample(model, tokenizer, prompt_ids: list[list[int]], new_tokens: int) -> list[dict]:
  import torch
  ids = torch.tensor(prompt_ids, device=model.device)
  with torch.no_grad():
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                         temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=tokenizer.eos_token_id,
                         eos_token_id=None, repetition_penalty=1.0)
  records = []
  for row in out.tolist():
    sampled = row[PROMPT_TOKENS:]
    if tokenizer.eos_token_id in sampled:  # the teacher's own end: the last of its samples
      sampled = sampled[:sampled.index(tokenizer.eos_token_id) + 1]
    records.append({"input_ids": row[:PROMPT_TOKENS] + sampled,
                    "loss_mask": [0] * PROMPT_TOKENS + [1] * len(sampled)})
  return records


def write_split(model, tokenizer, args, name: str, tokens: int, skip: int) -> int:
  final = os.path.join(args.out, f"{name}.jsonl")
  if os.path.exists(final):
    return sum(1 for _ in open(final))
  partial = final + ".partial"
  done = sum(1 for _ in open(partial)) if os.path.exists(partial) else 0
  per_doc = PROMPT_TOKENS + args.new_tokens
  total = -(-tokens // per_doc)
  all_prompts = prompts(args.prompts, tokenizer, total, skip)
  start = time.perf_counter()
  while done < total:
    batch = all_prompts[done:done + args.batch_size]
    records = sample(model, tokenizer, batch, args.new_tokens)
    with open(partial, "a") as f:
      f.writelines(json.dumps(r) + "\n" for r in records)
    done += len(records)
    rate = done * per_doc / (time.perf_counter() - start)
    print(f"{name}: {done}/{total} documents, {rate / 1e3:.1f}k tokens/s", flush=True)
  os.replace(partial, final)
  return total


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--hf", required=True, help="the teacher's Hugging Face checkpoint dir")
  parser.add_argument("--prompts", required=True, help="jsonl whose documents start the samples")
  parser.add_argument("--out", required=True)
  parser.add_argument("--train-tokens", type=int, default=4_000_000)
  parser.add_argument("--eval-tokens", type=int, default=300_000)
  parser.add_argument("--new-tokens", type=int, default=504, help="sampled tokens per document")
  parser.add_argument("--batch-size", type=int, default=1024)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  import torch  # after the arguments: --help needs neither torch nor transformers
  import transformers
  os.makedirs(args.out, exist_ok=True)
  torch.manual_seed(args.seed)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  dtype = torch.bfloat16 if device == "cuda" else torch.float32  # as kdjax runs the teacher
  tokenizer = transformers.AutoTokenizer.from_pretrained(args.hf)
  model = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype=dtype).to(device)
  model.eval()
  start = time.perf_counter()
  docs = {"train": write_split(model, tokenizer, args, "train", args.train_tokens, 0)}
  # Eval prompts come from later documents than train's: no shared prompt.
  docs["eval"] = write_split(model, tokenizer, args, "eval", args.eval_tokens, docs["train"])
  manifest = {"teacher": args.hf, "format": "input_ids", "prompt_tokens": PROMPT_TOKENS, "new_tokens": args.new_tokens,
              "temperature": 1.0, "documents": docs, "seed": args.seed, "device": device,
              "dtype": str(dtype), "seconds": time.perf_counter() - start}
  with open(os.path.join(args.out, "manifest.json"), "w") as f:
    json.dump(manifest, f, indent=2)
  print(json.dumps(manifest), flush=True)


if __name__ == "__main__":
  main()
