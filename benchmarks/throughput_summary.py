"""Condenses a `benchmarks/throughput.py` table run with both `--jit-compile` values.

One row per model: tfdp's whole-fit examples/s and DP/plain ratios (step /
whole fit) without XLA, with XLA, and with XLA under each other dtype
policy measured, then XLA's whole-fit speed-up of the DP fit in float32.
Reads the Markdown rows throughput.py printed (every other line is
skipped) and prints a Markdown table.

    python benchmarks/throughput_summary.py benchmarks/results/throughput_gpu_h100.md
"""

import argparse


def read_rows(path):
    """{(model, dtype, xla): row} from throughput.py's Markdown rows."""
    rows = {}
    with open(path) as handle:
        for line in handle:
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) < 10 or cells[3] not in ("yes", "no"):
                continue
            model, batch, dtype, xla = cells[:4]
            keras_fit, tfdp_fit = (float(cells[i].split("/")[1]) for i in (6, 7))
            rows[(model, dtype, xla == "yes")] = {
                "batch": batch, "keras_fit": keras_fit, "tfdp_fit": tfdp_fit, "ratios": cells[8]}
    return rows


def summarize(rows):
    """Markdown lines: one per model, variants in a fixed column order."""
    models = list(dict.fromkeys(model for model, _, _ in rows))
    others = sorted({dtype for _, dtype, _ in rows} - {"float32"})
    variants = [("float32", False), ("float32", True)] + [(dtype, True) for dtype in others]
    names = {("float32", False): "float32", ("float32", True): "float32 + XLA"}
    header = ["model", "batch", "Keras fit ex/s (float32)"]
    for variant in variants:
        name = names.get(variant, f"{variant[0]} + XLA")
        header += [f"tfdp fit ex/s, {name}", f"DP/plain (step / fit), {name}"]
    header.append("XLA's DP fit speed-up (float32)")
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for model in models:
        base = rows[(model, "float32", False)]
        cells = [model, base["batch"], f"{base['keras_fit']:,.0f}"]
        for variant in variants:
            row = rows.get((model, *variant))
            cells += ["-", "-"] if row is None else [f"{row['tfdp_fit']:,.0f}", row["ratios"]]
        xla = rows.get((model, "float32", True))
        cells.append("-" if xla is None else f"{xla['tfdp_fit'] / base['tfdp_fit']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("path", help="a file holding throughput.py's output")
    print("\n".join(summarize(read_rows(parser.parse_args().path))))


if __name__ == "__main__":
    main()
