"""What identifying work by its samples costs the validator's ledger, measured in one run on this machine.

Usage: .venv/bin/python benchmarks/work_identity.py [--files N] [--rows R] [--synchronous FULL|NORMAL]

Records N accepted verdicts of R rows each twice, in two fresh ledgers: once as before work identities
(the verdict alone) and once as the validator does now (the early lookup of every row's identity,
`Ledger.accepted_holder`, then the verdict recorded with its identities in the same transaction). Prints the
time per file of each, their ratio, and the ledger's growth per accepted sample. The per-file verification
it adds to (seconds of prefill per file; benchmarks/validator.py) dwarfs both.
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path

from prime_node.p2p.identity import Identity
from prime_node.p2p.verdicts import Verdict, sign
from prime_node.proofs.work_identity import SampleId
from prime_node.trainer.ledger import Ledger, LedgerSettings


def _run(path: Path, files: int, rows: int, synchronous: str, with_ids: bool) -> tuple[float, int]:
    validator, node = Identity.generate(), Identity.generate().node_id
    with Ledger(path, settings=LedgerSettings(path=path, synchronous=synchronous)) as ledger:
        start = time.perf_counter()
        for batch in range(files):
            ids = [
                SampleId("bench", node, 7, batch, 1000 + i // 4, 10**15 + batch * 10_000 + i)
                for i in range(rows)
            ]
            if with_ids:
                assert ledger.accepted_holder(ids) is None
            verdict = Verdict(
                file_hash=hashlib.sha256(str(batch).encode()).hexdigest(),
                node_id=node,
                step=7,
                samples=rows,
                tokens=rows * 64,
                accepted=True,
                validator_id=validator.node_id,
                decided_at=time.time(),
            )
            ledger.record(sign(verdict, validator), samples=ids if with_ids else ())
        seconds = time.perf_counter() - start
        ledger.query("PRAGMA wal_checkpoint(TRUNCATE)")
    return seconds / files, path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=500)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--synchronous", choices=("FULL", "NORMAL"), default="FULL")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [
            _run(Path(tmp) / f"{name}.sqlite", args.files, args.rows, args.synchronous, with_ids)
            for name, with_ids in (("before", False), ("after", True))
        ]
    (before, size_before), (after, size_after) = runs
    print(f"{args.files} accepted files x {args.rows} rows, synchronous={args.synchronous}:")
    print(f"  verdict only:                     {before * 1e3:.2f} ms per file")
    print(f"  lookup + verdict with identities: {after * 1e3:.2f} ms per file ({after / before:.2f}x)")
    growth = (size_after - size_before) / (args.files * args.rows)
    print(f"  ledger growth per accepted sample: {growth:.0f} bytes")


if __name__ == "__main__":
    main()
