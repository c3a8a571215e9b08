"""The proof statistics of `prime-node verify --json` reports against the calibrated bounds (docs/proofs.md).

Usage: .venv/bin/python benchmarks/proof_margins.py verify-MADE-on-CHECKED-DTYPE[-bBATCH].json ...

benchmarks/gpu_checks.sh writes one report per direction and dtype (made on CUDA, checked on CPU, and the
reverse); this prints, per report, the verdict and each statistic beside its bound, with the margin as
bound / value (above 1: inside the bound; the larger, the more room). The statistics are those the checks
print: the file's typical chunk mantissa error and its worst chunk's exponent mismatches (toploc), the
tolerated near-ties (sampling) and the log-probability z-score (distribution).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from prime_node.proofs.bounds import SamplingThresholds, ToplocThresholds

NAME = re.compile(
    r"verify-(?P<made>[a-z]+)-on-(?P<checked>[a-z]+)-(?P<dtype>float32|bfloat16)(-b(?P<batch>\d+))?\.json$"
)


def number(pattern: str, text: str) -> float | None:
    found = re.search(pattern, text)
    return float(found.group(1)) if found else None


def margin(bound: float, value: float | None) -> str:
    if value is None:
        return "n/a"
    return "inf" if value == 0 else f"{bound / value:.2f}x"


def describe(path: Path) -> str:
    name = NAME.search(path.name)
    if name is None:
        return f"{path.name}: not named verify-MADE-on-CHECKED-DTYPE.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"{path.name}: unreadable report ({exc})"
    dtype = name["dtype"]
    toploc, sampling = ToplocThresholds.for_precision(dtype), SamplingThresholds.for_precision(dtype)  # type: ignore[arg-type]
    details = {c["name"]: c["detail"] for c in report.get("checks", [])}
    typical = number(r"typical mantissa error ([\d.]+)", details.get("toploc", ""))
    worst = number(r"worst chunk (\d+) exponent", details.get("toploc", ""))
    ties = number(r"\((\d+) tolerated near-ties\)", details.get("sampling", ""))
    z = number(r"z-score (-?[\d.]+)", details.get("distribution", ""))
    verdict = "ACCEPTED" if report.get("accepted") else "REJECTED: " + "; ".join(report.get("reasons", []))
    return "\n".join(
        [
            f"{name['made']} -> {name['checked']}, {dtype}, batch {name['batch'] or 0}: {verdict}",
            f"  toploc typical mantissa error {typical} (bound {toploc.max_typical_mant_err_mean}, margin "
            f"{margin(toploc.max_typical_mant_err_mean, typical)}); worst chunk exponent mismatches {worst} "
            f"(cap {toploc.max_exp_mismatches}, margin {margin(toploc.max_exp_mismatches, worst)})",
            f"  sampling near-ties tolerated {ties} (margin {sampling.margin} logits/T, fraction "
            f"{sampling.max_near_tie_fraction} + {sampling.near_tie_slack} per sample); distribution |z| "
            f"{abs(z) if z is not None else None} (bound {sampling.max_abs_z}, margin "
            f"{margin(sampling.max_abs_z, abs(z) if z is not None else None)})",
        ]
    )


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__.splitlines()[2])
    for arg in sys.argv[1:]:
        print(describe(Path(arg)))


if __name__ == "__main__":
    main()
