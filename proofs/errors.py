"""The one exception base of the proofs package; every error raised here derives from it."""


class ProofError(Exception):
    """Base class of errors raised by prime_node.proofs."""
