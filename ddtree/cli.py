"""`ddtree` command line: one subcommand per job, each dispatching to the library."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree", description="DDTree Serve command line")
    subcommands = parser.add_subparsers(dest="command", required=True)

    from ddtree.training import pipeline

    train_drafter = subcommands.add_parser(
        "train-drafter", help="make prompts, generate target data, train and evaluate a DFlash drafter")
    pipeline.add_arguments(train_drafter)
    train_drafter.set_defaults(handler=pipeline.run)

    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
