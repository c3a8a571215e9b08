"""The one exception base of the trainer package; every error raised here derives from it."""


class TrainerError(Exception):
    """Base class of errors raised by prime_node.trainer."""
