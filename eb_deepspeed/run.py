"""Run a training script unedited with every `deepspeed.initialize` in it applying its config's `easybalance` block
(`patch_deepspeed`): Hugging Face Trainer, TRL, Accelerate and Lightning scripts included.

    python -m eb_deepspeed.run train.py --deepspeed ds_config.json ...
    deepspeed --num_gpus 8 --module eb_deepspeed.run train.py ...          # the launcher's --local_rank=N passes on
    torchrun --nproc_per_node 8 -m eb_deepspeed.run train.py ...
    accelerate launch -m eb_deepspeed.run train.py ...

The script runs as `python train.py ...` would: `sys.argv` is the script and its arguments (a launcher's own
`--local_rank` first, as the launcher passes it), and it runs as `__main__`."""
from __future__ import annotations

import runpy
import sys

__all__ = ["main"]


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    launcher = []                              # `deepspeed --module` puts --local_rank=N before the script
    while argv and argv[0].startswith(("--local_rank", "--local-rank")):
        launcher.append(argv.pop(0))
        if "=" not in launcher[-1] and argv:
            launcher.append(argv.pop(0))
    if not argv:
        raise SystemExit("usage: python -m eb_deepspeed.run SCRIPT [ARGS...]")
    from .adapters.deepspeed import patch_deepspeed
    patch_deepspeed()
    sys.argv = [argv[0], *launcher, *argv[1:]]
    sys.path.insert(0, __import__("os").path.dirname(__import__("os").path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
