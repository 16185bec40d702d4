"""tools/trace_cost.py: the default call costs what the xla backend costs on
the CPU."""

import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).parents[2] / "tools" / "trace_cost.py"
_SPEC = importlib.util.spec_from_file_location("trace_cost", _PATH)
trace_cost = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(trace_cost)


def test_default_costs_what_xla_costs_on_the_cpu(capsys):
  rows = [trace_cost.measure(impl, (1, 64, 2, 16), repeats=1)
          for impl in (None, "xla")]
  assert rows[0]["jaxpr_lines"] == rows[1]["jaxpr_lines"] > 50
  assert rows[0]["pallas_calls"] == rows[1]["pallas_calls"] == 0
  trace_cost.main(["--impls", "None", "--shape", "1,64,2,16",
                   "--repeats", "1"])
  assert "| None |" in capsys.readouterr().out
