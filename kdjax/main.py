"""Entry point: `python -m kdjax.main --config=configs/demo.py [--config.x=y ...]`.

Bad input (kdjax.errors) prints one message and exits 1; --debug or KDJAX_DEBUG=1 adds its
traceback. Ctrl-C (or SIGTERM while training or writing the cache) exits 130 after the run saved
its checkpoint or its finished cache regions. Of several processes, one lost, or ended with its
own error, makes the others print which and exit 75 (kdjax.peers).
"""
import logging
import os
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from kdjax import config, errors, parallel, peers, pipeline, workdir
from kdjax.models import fp8

config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
flags.DEFINE_bool("debug", False, "Show the traceback of user errors too (or set KDJAX_DEBUG=1).")
flags.mark_flags_as_required(["config"])


def parse_flags(argv):
  """absl's parsing, but an override naming no config field is one line, not three tracebacks."""
  try:
    return app.parse_flags_with_usage(argv)
  except (AttributeError, KeyError):
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None or errors.debug() or "--debug" in argv:
      raise
    message = config.unknown_override(flags.FLAGS["config"].parser.parse(path), argv)
    if message is None:
      raise
    sys.exit(errors.message(message))


def main(argv):
  del argv
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every checkpoint at INFO
  c = flags.FLAGS.config
  parallel.claim_memory(c.mesh.memory_fraction, c.mesh.allocator)
  fp8.prepare_compiler(c.student.fp8_matmuls)
  if workdir.compile_cache_dir(c):  # before anything compiles
    jax.config.update("jax_compilation_cache_dir", os.path.abspath(workdir.compile_cache_dir(c)))
  # a run of several processes (launch/multiprocess.sh): each watches the others (kdjax.peers)
  parallel.initialize_distributed(c.mesh.failure_timeout_s)
  peers.watch(c.mesh.failure_timeout_s)
  logging.info("process %d of %d; devices: %s", jax.process_index(), jax.process_count(),
               jax.devices())
  try:
    pipeline.run(c)
  except KeyboardInterrupt:
    peers.finish()
    sys.exit(130)  # train.fit has saved and logged its last step
  except Exception as e:
    peers.fail_if_lost()  # a collective failed because another process was lost: say so
    peers.finish(error=True)  # the others stop too, naming this one
    if flags.FLAGS.debug or errors.debug() or not errors.is_user_error(e):
      raise
    sys.exit(errors.message(e))
  peers.finish()


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
