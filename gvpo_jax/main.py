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
# A fault that stopped a run of valid input (errors.FaultError: a full disk, every update
# non-finite), one sentence with exit status 1; the checkpoints before it are intact.
EXIT_FAULT = 1


def bad_input(sentence: str, status: int = EXIT_BAD_INPUT):
    """Ends the process the way every bad input ends: `error: <one sentence>`, exit status 2
    (`status`: EXIT_FAULT for a fault that is not the input's).

    The exit skips the interpreter's shutdown (the run has closed its writer and checkpoints
    by then): after a failed checkpoint read, tensorstore's abandoned reads would otherwise
    finish during shutdown and print pages of "Event loop is closed" from Orbax's event loop."""
    print(f"error: {sentence}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, except that a bad flag or `--config.` field is one sentence and exit
    status 2 (absl exits 1 after two sentences; ml_collections raises a KeyError traceback)."""
    try:
        return flags.FLAGS(argv)
    except (
        flags.Error,
        KeyError,
        AttributeError,
        OSError,
        TypeError,
        ValueError,
        SyntaxError,
    ) as e:
        from gvpo_jax import config as config_lib

        bad_input(config_lib.flag_error_sentence(argv, e))


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    from gvpo_jax import config as config_lib

    config = _CONFIG.value
    if config is None:
        bad_input("--config is required; pass one such as --config=configs/arith_tiny.py.")
    try:
        _ = config.mode  # ml_collections reports a config file that failed to load only here
    except OSError as e:
        reason = str(e).strip().splitlines()[-1].strip()
        bad_input(f"the config file could not be loaded ({reason}); pass an existing file.")
    workdir = _WORKDIR.value or os.path.join(
        "runs", os.path.splitext(os.path.basename(flags.FLAGS["config"].config_filename))[0]
    )
    try:
        config_lib.validate(config)
        from gvpo_jax import programs, sharding, train

        programs.tune_gc()
        m = config.mesh
        sharding.maybe_initialize_distributed(  # before anything touches a device
            m.coordinator_address or None,
            None if m.num_processes < 0 else m.num_processes,
            None if m.process_id < 0 else m.process_id,
            mode=m.distributed,
        )
        train.run(config, workdir)
    except errors.BadInputError as e:
        bad_input(str(e))
    except errors.FaultError as e:
        bad_input(str(e), status=EXIT_FAULT)


if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
