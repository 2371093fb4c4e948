"""A run's files and its tokenizer: `Paths`, made once per run from the config.

The one place that decides which tokenizer a run uses (data.tokenizer, else the one stage data
trains into the workdir) and which one its student reads (a student checkpoint's own, else the
run's), and that loads each once: checks, the data stage and every later stage ask it.
"""
import dataclasses
import os

from kdjax import tokenizer
from kdjax.tokenizer import Tokenizer


def checkpoint_dir(run_dir: str) -> str:
  """A training run's orbax checkpoints: one folder per step."""
  return os.path.join(run_dir, "ckpt")


def metrics_file(run_dir: str) -> str:
  """A training run's metrics: one JSON line per logged step."""
  return os.path.join(run_dir, "metrics.jsonl")


def tensorboard_dir(run_dir: str) -> str:
  """A training run's TensorBoard events."""
  return os.path.join(run_dir, "tensorboard")


def compile_cache_dir(c) -> str:
  """The folder of the run's compiled programs (config compile_cache), or "" when off."""
  return os.path.join(c.workdir, "compile_cache") if c.compile_cache == "workdir" else (
      c.compile_cache)


@dataclasses.dataclass(frozen=True)
class Paths:
  """Where a run's files are, and its tokenizers (loaded on first use, then kept)."""
  workdir: str
  cache_dir: str
  tokenizer_path: str  # data.tokenizer, else the one stage data trains (trained_tokenizer)
  trains_tokenizer: bool = False  # data.tokenizer is empty: stage data trains tokenizer_path
  student_checkpoint: str = ""  # student.hf_path: it may bring its own tokenizer
  _loaded: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  @classmethod
  def from_config(cls, c) -> "Paths":
    return cls(c.workdir, c.cache.path or os.path.join(c.workdir, "cache"),
               c.data.tokenizer or os.path.join(c.workdir, "data", "tokenizer.json"),
               not c.data.tokenizer, c.student.hf_path)

  def data(self, split: str) -> str:
    return os.path.join(self.workdir, "data", f"{split}.zarr")

  def cache(self, split: str) -> str:
    return os.path.join(self.cache_dir, f"{split}.zarr")

  def run(self, name: str) -> str:
    """A training run's folder (teacher, student, baseline) or export's."""
    return os.path.join(self.workdir, name)

  def checkpoints(self, name: str) -> str:
    return checkpoint_dir(self.run(name))

  def metrics(self, name: str) -> str:
    return metrics_file(self.run(name))

  @property
  def config_file(self) -> str:
    """The resolved config of the latest run."""
    return os.path.join(self.workdir, "config.json")

  @property
  def stages_file(self) -> str:
    """One line per finished stage: wall time, peak device memory."""
    return os.path.join(self.workdir, "stages.jsonl")

  @property
  def eval_file(self) -> str:
    return os.path.join(self.workdir, "eval.json")

  @property
  def curves_file(self) -> str:
    return os.path.join(self.workdir, "curves.png")

  @property
  def trained_tokenizer(self) -> str:
    return os.path.join(self.workdir, "data", "tokenizer.json")

  @property
  def tokenizer_dir(self) -> str:
    """The folder holding the run's tokenizer.json (and tokenizer_config.json, if any)."""
    return (self.tokenizer_path if os.path.isdir(self.tokenizer_path)
            else os.path.dirname(self.tokenizer_path))

  def tokenizer(self) -> Tokenizer:
    """The run's tokenizer; raises (naming the file) where it is missing or unreadable."""
    return self._load(self.tokenizer_path)

  def tokenizer_or_none(self) -> Tokenizer | None:
    """The run's tokenizer, or None while stage data is still to train it."""
    if self.trains_tokenizer and not os.path.exists(self.tokenizer_path):
      return None
    return self.tokenizer()

  @property
  def student_tokenizer_dir(self) -> str:
    """The folder of the student's tokenizer (student_tokenizer), as export writes it."""
    return self.student_checkpoint if self._student_brings_tokenizer() else self.tokenizer_dir

  def student_tokenizer(self) -> Tokenizer:
    """A student from a checkpoint brings its own tokenizer, else reads the run's; the cache's
    must be the same."""
    if self._student_brings_tokenizer():
      return self._load(self.student_checkpoint)
    return self.tokenizer()

  def _student_brings_tokenizer(self) -> bool:
    return bool(self.student_checkpoint) and os.path.exists(
        os.path.join(self.student_checkpoint, "tokenizer.json"))

  def _load(self, path: str) -> Tokenizer:
    # Once per path and process: a tokenizer of 128k tokens takes a second to parse.
    if path not in self._loaded:
      self._loaded[path] = tokenizer.load(path)
    return self._loaded[path]
