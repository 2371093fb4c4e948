"""A GGUF checkpoint to a float32 Hugging Face directory; runs under a Python with torch.

    PY kdjax/smollm2/convert.py FILE.gguf OUT_DIR

Needs torch, transformers, safetensors, gguf and accelerate (the side venv,
kdjax.smollm2.side_venv), and imports nothing from kdjax (whose Python may lack torch).
transformers' GGUF reader dequantises every tensor (Q4_1 here) on load; the model is saved as
float32 safetensors with the tokenizer rebuilt from the GGUF's vocabulary (tokenizer.json,
tokenizer_config.json, chat_template.jinja). kdjax.smollm2 runs it and stamps the result.
"""
import os
import sys

# Run as a script, this file's folder (kdjax/smollm2/) heads sys.path, and its modules (corpus.py,
# convert.py, ...) could shadow installed packages of the same names.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import torch  # noqa: E402
import transformers  # noqa: E402


def convert(gguf_path: str, out_dir: str) -> None:
  folder, name = os.path.split(os.path.abspath(gguf_path))
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                            dtype=torch.float32)
  tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
  # The weights are dequantised floats now; the quantizer marker would make save_pretrained
  # refuse (or record a quantization_config the saved tensors do not have).
  model.hf_quantizer = None
  if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
  model.save_pretrained(out_dir, safe_serialization=True)
  tokenizer.save_pretrained(out_dir)


if __name__ == "__main__":
  if len(sys.argv) != 3:
    sys.exit(__doc__.split("\n\n")[1].strip())
  convert(sys.argv[1], sys.argv[2])
