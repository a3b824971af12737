"""MkDocs hook: the benchmark plots become files of the site.

benchmarks/results.py writes RESULTS.md with its plots in benchmarks/results/
(`![...](benchmarks/results/frontier.png)`); docs/results/fashion-mnist.md
includes RESULTS.md as it is (pymdownx.snippets), so those links resolve to
results/benchmarks/results/*.png inside the site. This hook serves the PNG
files from the repository at that path, so neither the table nor the plots
are copied by hand.
"""

import glob
import os

from mkdocs.structure.files import File

PLOTS = os.path.join("benchmarks", "results")
SITE_FOLDER = "results/benchmarks/results"


def on_files(files, config):
    root = os.path.dirname(config["config_file_path"])
    for path in sorted(glob.glob(os.path.join(root, PLOTS, "*.png"))):
        files.append(
            File.generated(config, f"{SITE_FOLDER}/{os.path.basename(path)}", abs_src_path=path)
        )
    return files
