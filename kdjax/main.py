"""Entry point: `python -m kdjax.main --config=configs/demo.py [--config.x=y ...]`."""
import logging

import jax
from absl import app, flags
from ml_collections import config_flags

from kdjax import pipeline

config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.", lock_config=True)
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv
  logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every checkpoint at INFO
  logging.info("devices: %s", jax.devices())
  pipeline.run(flags.FLAGS.config)


if __name__ == "__main__":
  app.run(main)
