"""The two ways a run ends early: bad input (exit status 2) and a fault at run time (exit 1)."""


class BadInputError(ValueError):
    """Input that cannot work (a config field, a file, a checkpoint, a dataset, a mesh); the
    message is one sentence that names the input and the fix. Each module raises its own
    subclass (`config.ConfigError`, `checkpoint.CheckpointError`, `tasks.DataError`, ...)."""


class FaultError(RuntimeError):
    """A run that cannot go on although its input was valid (a full disk, every update
    non-finite); the message is one sentence, and the checkpoints written before it are intact.
    The CLI prints it and exits with status 1 (`checkpoint.CheckpointWriteError` and
    `rl_step.TrainingError` are ones)."""
