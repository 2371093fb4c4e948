"""Reference side of the Hugging Face parity tests; runs under transformers + CPU torch.

    .venv-hf/bin/python kdjax/smollm2/hf_reference.py jobs.json

Runs in the side venv (kdjax.smollm2.side_venv; Python 3.11: the CPU torch build these machines
carry), never in kdjax's venv, and imports nothing from kdjax; tests/fixtures/hf_side.py and
experiments/studies/smollm2_study.py run it. jobs.json:

    {"make":   [{"dir", "model_type", "config": {...}, "seed", "max_shard_size" (or null),
                 "tokenizer_vocab" (or null)}],
     "dequantize": [{"dir", "out_dir"}],
     "logits": [{"dir", "inputs": "x.npz" (tokens, positions, segment_ids [B, T]), "out": "y.npy"}],
     "nll": [{"dir", "inputs": "x.npz" (the same + loss_mask [B, T]), "out": "y.json"}]}

"make" saves a tiny random model (norm scales, biases and attention sinks randomised too, so a
swapped or dropped one shows) and, with tokenizer_vocab, a word-level tokenizer.json defining
that many tokens. "logits" loads a directory with AutoModelForCausalLM and writes float64 logits
[B, T, V], running each document (contiguous run of one nonzero segment id) alone with its
position ids; padding rows stay zero. "nll" scores a checkpoint on packed rows as a user would
(float32, on the GPU when torch has one, each document alone): the mean negative log-likelihood
of token t + 1 at every position t that loss_mask marks, {"mean_nll", "positions"}. "dequantize"
rewrites an MXFP4 gpt-oss checkpoint (a single model.safetensors) with float experts, decoded by
transformers' own MXFP4 converter.
"""
import json
import os
import sys

# Run as a script, this file's folder (kdjax/smollm2/) heads sys.path, and its modules (corpus.py,
# convert.py, ...) could shadow installed packages of the same names.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402


def make(job: dict) -> None:
  torch.manual_seed(job["seed"])
  config = transformers.AutoConfig.for_model(job["model_type"], **job["config"])
  model = transformers.AutoModelForCausalLM.from_config(config).float()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith(("bias", "sinks")):
        p.copy_(0.5 * torch.randn_like(p))
  kwargs = {"max_shard_size": job["max_shard_size"]} if job.get("max_shard_size") else {}
  model.save_pretrained(job["dir"], **kwargs)
  if job.get("tokenizer_vocab"):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(job["tokenizer_vocab"] - 1)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|endoftext|>"])  # an added token: the real vocab counts it
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(job["dir"])


def dequantize(job: dict) -> None:
  import os

  from safetensors.torch import load_file, save_file
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  tensors = load_file(os.path.join(job["dir"], "model.safetensors"))
  for name in [n for n in tensors if n.endswith("_blocks")]:
    stem = name[:-len("_blocks")]
    tensors[stem] = convert_moe_packed_tensors(tensors.pop(name), tensors.pop(stem + "_scales"))
  os.makedirs(job["out_dir"], exist_ok=True)
  save_file(tensors, os.path.join(job["out_dir"], "model.safetensors"), metadata={"format": "pt"})
  with open(os.path.join(job["dir"], "config.json")) as f:
    config = json.load(f)
  del config["quantization_config"]
  with open(os.path.join(job["out_dir"], "config.json"), "w") as f:
    json.dump(config, f)


def logits(job: dict) -> None:
  # Eager attention and experts: the reference implementations (grouped_mm has no float64).
  model = transformers.AutoModelForCausalLM.from_pretrained(
      job["dir"], attn_implementation="eager", experts_implementation="eager").double().eval()
  data = np.load(job["inputs"])
  tokens, positions, segment_ids = data["tokens"], data["positions"], data["segment_ids"]
  out = np.zeros(tokens.shape + (model.config.vocab_size,), np.float64)
  for b in range(tokens.shape[0]):
    for t, end in documents(segment_ids[b]):
      with torch.no_grad():
        result = model(input_ids=torch.tensor(tokens[b:b + 1, t:end], dtype=torch.long),
                       position_ids=torch.tensor(positions[b:b + 1, t:end], dtype=torch.long))
      out[b, t:end] = result.logits[0].numpy()
  np.save(job["out"], out)


def documents(segment_ids_T):
  """[(start, end)] of each run of one nonzero segment id."""
  out, t = [], 0
  while t < len(segment_ids_T):
    end = t
    while end < len(segment_ids_T) and segment_ids_T[end] == segment_ids_T[t]:
      end += 1
    if segment_ids_T[t] != 0:
      out.append((t, end))
    t = end
  return out


def nll(job: dict) -> None:
  device = "cuda" if torch.cuda.is_available() else "cpu"
  model = transformers.AutoModelForCausalLM.from_pretrained(job["dir"]).float().to(device).eval()
  data = np.load(job["inputs"])
  total, count = 0.0, 0
  for b in range(data["tokens"].shape[0]):
    for t, end in documents(data["segment_ids"][b]):
      ids = torch.tensor(data["tokens"][b:b + 1, t:end], dtype=torch.long, device=device)
      with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.tensor(
            data["positions"][b:b + 1, t:end], dtype=torch.long, device=device)).logits[0]
      logp = torch.log_softmax(logits[:-1].double(), -1).gather(1, ids[0, 1:, None])[:, 0]
      mask = torch.tensor(data["loss_mask"][b, t:end - 1], device=device)
      total -= float(logp[mask].sum())
      count += int(mask.sum())
  with open(job["out"], "w") as f:
    json.dump({"mean_nll": total / max(count, 1), "positions": count}, f)


def main() -> None:
  with open(sys.argv[1]) as f:
    jobs = json.load(f)
  for job in jobs.get("make", []):
    make(job)
  for job in jobs.get("dequantize", []):
    dequantize(job)
  for job in jobs.get("logits", []):
    logits(job)
  for job in jobs.get("nll", []):
    nll(job)
  print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}))


if __name__ == "__main__":
  main()
