"""The base class of every bad-input error: the CLI prints its one sentence and exits with 2."""


class BadInputError(ValueError):
    """Input that cannot work (a config field, a file, a checkpoint, a dataset, a mesh); the
    message is one sentence that names the input and the fix. Each module raises its own
    subclass (`config.ConfigError`, `checkpoint.CheckpointError`, `tasks.DataError`, ...)."""
