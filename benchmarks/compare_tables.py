"""Ratios of two `benchmarks/throughput.py` tables: this code over a baseline.

Reads Markdown files holding the tables `throughput.py` printed (several
calls each, interleaved with the baseline's) and prints, per model, tfdp's
examples/s of each call of the new code over the call of the baseline made
just before it, inside the step and over the whole fit, and the DP/plain
ratios of both. Nothing is measured here: it only divides printed numbers.

    python benchmarks/compare_tables.py --baseline old1.md old2.md --new new1.md new2.md
"""

import argparse
import re


def read_table(path):
    """{model: (tfdp step ex/s, tfdp fit ex/s, DP/plain step, DP/plain fit)}."""
    rows = {}
    for line in open(path, encoding="utf-8"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 9 or not re.fullmatch(r"[\d.]+ / [\d.]+", cells[7] or ""):
            continue
        step, fit = (float(v) for v in cells[7].split(" / "))
        ratio_step, ratio_fit = (float(v) for v in cells[8].split(" / "))
        rows[cells[0]] = (step, fit, ratio_step, ratio_fit)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", nargs="+", required=True)
    parser.add_argument("--new", nargs="+", required=True)
    args = parser.parse_args()
    if len(args.baseline) != len(args.new):
        parser.error("give one baseline table per new table (the calls were interleaved)")
    pairs = [(read_table(b), read_table(n)) for b, n in zip(args.baseline, args.new)]
    print("| model | call | tfdp new/old (step) | tfdp new/old (fit) | DP/plain old (step / fit) "
          "| DP/plain new (step / fit) |")
    print("|---|---|---|---|---|---|")
    for model in pairs[0][0]:
        for call, (old, new) in enumerate(pairs, 1):
            if model not in old or model not in new:
                continue
            o, n = old[model], new[model]
            print(f"| {model} | {call} | {n[0] / o[0]:.2f} | {n[1] / o[1]:.2f} | "
                  f"{o[2]:.2f} / {o[3]:.2f} | {n[2]:.2f} / {n[3]:.2f} |")


if __name__ == "__main__":
    main()
