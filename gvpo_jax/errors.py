"""Bad-input error types of every module: the CLI prints their one sentence and exits 2."""


def bad_input_errors() -> tuple[type[BaseException], ...]:
    from gvpo_jax import checkpoint, models, sharding, tasks
    from gvpo_jax.config import ConfigError

    return (
        ConfigError,
        models.CheckpointError,
        checkpoint.CheckpointError,
        tasks.DataError,
        sharding.ShardingError,
    )
