"""Print the sbatch script `vec-inf launch MODEL --config FILE` would submit, submitting nothing.

Runs under vec-inf's own interpreter (it imports vec_inf; bench/launch.py runs it with
.venvs/vec-inf/bin/python before it measures, to check that vec-inf's job starts the same vLLM
with the same resources as the other contenders'). The environment is the caller's: name the
cluster environment's directory in VEC_INF_CONFIG_DIR, as for `vec-inf launch`. Builds the
launch parameters as `vec-inf launch` does (the same validation; vec-inf also creates
LOG_DIR/MODEL_FAMILY then) through vec-inf's private classes, so it is pinned to vec-inf 0.9.0.

    VEC_INF_CONFIG_DIR=DIR .venvs/vec-inf/bin/python bench/_launch/render_vec_inf.py MODEL \\
        --config FILE
"""

from __future__ import annotations

import argparse
import importlib
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    ap.add_argument("model")
    ap.add_argument("--config", required=True, help="the model config (`vec-inf launch --config`)")
    args = ap.parse_args()
    helper = importlib.import_module("vec_inf.client._helper")
    generator = importlib.import_module("vec_inf.client._slurm_script_generator")
    launcher = helper.ModelLauncher(args.model, {"config": args.config})
    print(generator.SlurmScriptGenerator(launcher.params)._generate_script_content())
    return 0


if __name__ == "__main__":
    sys.exit(main())
