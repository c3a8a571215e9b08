"""The one exception base of the p2p package; every error raised here derives from it."""


class P2PError(Exception):
    """Base class of errors raised by prime_node.p2p."""


class KeyFileError(P2PError):
    """A key file is missing, malformed, has unsafe permissions, or would be overwritten."""


class SignatureError(P2PError):
    """A signature does not verify, or a signed document is malformed."""


class UnsignableDocument(SignatureError):
    """A document has no canonical JSON form (a lone surrogate, NaN, nesting too deep): it can be neither
    signed nor verified, so a peer's document of this kind is refused like one with a bad signature."""
