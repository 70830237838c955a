"""The experiment scripts (run as `python experiments/NAME.py --config=configs/NAME.py`); a package
so that one script can import another's helpers."""
