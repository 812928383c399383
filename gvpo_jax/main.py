"""Entry point: `python -m gvpo_jax.main --config=configs/<name>.py [--workdir=DIR]`."""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from gvpo_jax import errors

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/<name>.py file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (default runs/<config name>).")

# Errors that mean "bad input", reported as one sentence with exit status 2 (absl's usage status).
EXIT_BAD_INPUT = 2


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    from gvpo_jax import config as config_lib

    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config is required, e.g. --config=configs/arith_tiny.py")
    workdir = _WORKDIR.value or os.path.join(
        "runs", os.path.splitext(os.path.basename(flags.FLAGS["config"].config_filename))[0]
    )
    try:
        config_lib.validate(config)
        from gvpo_jax import sharding, train

        m = config.mesh
        sharding.maybe_initialize_distributed(  # before anything touches a device
            m.coordinator_address or None,
            None if m.num_processes < 0 else m.num_processes,
            None if m.process_id < 0 else m.process_id,
            mode=m.distributed,
        )
        train.run(config, workdir)
    except errors.BadInputError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


if __name__ == "__main__":
    app.run(main)
