"""Offline training on fixed rows: `sft`, `dpo` and `rm` over one loop (loop.py), and the
launcher that starts their ranks (launch.py)."""
