"""The hivemind record validator that every swarm participant installs.

hivemind calls `validate` when a peer asks us to store a record and when a peer returns one to our
search; a record that fails is neither stored nor returned. Records arrive as bytes: the 20-byte key id,
the msgpack-serialized subkey and the msgpack-serialized value, so the checks here run on those bytes
and never trust anything inside before the signature over it verifies (see records.open_record).

Unlike hivemind's RSASignatureValidator, signing happens in the application (records.seal) rather than
in `sign_value`: the DHT child process then never holds a secret key, and an operator-signed record
(a ban, say) can be re-published verbatim by any node.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Iterable

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

from .errors import RecordError
from .records import MAX_VALUE_BYTES, RecordKind, key_id, open_record, unpack_scalar

logger = logging.getLogger(__name__)


ACCEPTED_CACHE_SIZE = 8192


def _record_digest(record: DHTRecord) -> bytes:
    h = hashlib.blake2b(digest_size=20)
    for part in (record.key, record.subkey, record.value):
        h.update(struct.pack(">I", len(part)))
        h.update(part)
    h.update(struct.pack(">d", record.expiration_time))
    return h.digest()


def unwrap_value(serialized: bytes) -> bytes:
    """hivemind msgpack-serializes the value we store (a byte string): undo that, with a size bound."""
    return unpack_scalar(serialized, bytes, MAX_VALUE_BYTES, "value")


class SwarmRecordValidator(RecordValidatorBase):
    """Refuses every record under this run's keys that is not a well-formed, correctly signed record.

    Keys that are not the run's are refused too: the run's DHT carries nothing else, and allowing
    unknown keys would give anyone free storage on every peer.
    """

    def __init__(self, run_id: str, operator_keys: Iterable[str]) -> None:
        self.run_id = run_id
        self.operator_keys = frozenset(operator_keys)
        self._kinds = {key_id(run_id, kind): kind for kind in RecordKind}
        # Digests of records already accepted. Every lookup of a key returns its whole table of subkeys
        # from each peer asked, so without this a read of N heartbeats re-verifies N signatures per
        # response. Identical bytes stay valid: the signature covers them all, and an expiry that was
        # near enough then is nearer now. Refusals are not remembered (that would let junk fill it).
        self._accepted: OrderedDict[bytes, None] = OrderedDict()

    def check(self, record: DHTRecord) -> object:
        """The parsed body of a valid record; RecordError naming the problem otherwise."""
        kind = self._kinds.get(record.key)
        if kind is None:
            raise RecordError(f"key id {record.key.hex()[:16]}… is not one of run {self.run_id!r}'s keys")
        value = unwrap_value(record.value)
        return open_record(
            kind, record.key, record.subkey, value, record.expiration_time, self.operator_keys, get_dht_time()
        )

    def validate(self, record: DHTRecord) -> bool:
        digest = _record_digest(record)
        if digest in self._accepted:
            self._accepted.move_to_end(digest)
            return True
        try:
            self.check(record)
        except RecordError as exc:
            # Debug, not warning: a hostile peer could otherwise flood every honest peer's log.
            logger.debug("refused DHT record: %s", exc)
            return False
        self._accepted[digest] = None
        if len(self._accepted) > ACCEPTED_CACHE_SIZE:
            self._accepted.popitem(last=False)
        return True

    @property
    def priority(self) -> int:
        # Run before any validator that would deserialize the value.
        return 20

    def merge_with(self, other: RecordValidatorBase) -> bool:
        # Two swarm validators for the same run are one; for different runs they must both apply.
        return isinstance(other, SwarmRecordValidator) and (other.run_id, other.operator_keys) == (
            self.run_id,
            self.operator_keys,
        )
