"""`adaflash controlplane` is offered by the CLI with its flags."""

from adaflash.cli import build_parser
from controlplane.cli import run


def test_controlplane_command_parses():
    args = build_parser().parse_args(["controlplane", "--host", "0.0.0.0", "--port", "9100"])
    assert args.func is run and args.host == "0.0.0.0" and args.port == 9100
