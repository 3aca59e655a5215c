"""Config file for the subprocess tests: `--config=tests/rl/tiny_arithmetic_config.py`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import rl_test_utils  # noqa: E402


def get_config():
  rl_test_utils.register_test_tasks()
  return rl_test_utils.run_config()
