"""Run at interpreter start by workers of the lm_resiliency torchrun backend (the backend puts this
folder first on their PYTHONPATH): see `lm_resiliency.worker_boot`. Then the next `sitecustomize`
on the path, if there is one, runs as it would have without us."""

import sys as _sys


def _lm_resiliency_boot() -> None:
    try:
        from lm_resiliency.worker_boot import boot, chain_next_sitecustomize

        boot()
        chain_next_sitecustomize(__file__)
    except Exception as exc:  # never break a worker's start-up
        _sys.stderr.write(f"lm_resiliency: worker boot failed: {exc!r}\n")


_lm_resiliency_boot()
