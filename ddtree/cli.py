"""`ddtree` command line: one subcommand per job, each dispatching to the library."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree", description="DDTree Serve command line")
    subcommands = parser.add_subparsers(dest="command", required=True)

    from ddtree import bench, cli_run
    from ddtree.training import pipeline

    generate = subcommands.add_parser("generate", help="generate from one prompt, streamed to the terminal")
    cli_run.add_generate_arguments(generate)
    generate.set_defaults(handler=cli_run.run_generate)

    chat = subcommands.add_parser("chat", help="interactive chat")
    cli_run.add_chat_arguments(chat)
    chat.set_defaults(handler=cli_run.run_chat)

    bench_parser = subcommands.add_parser(
        "bench", help="tokens/s and acceptance of off / dflash / ddtree (B sweep, auto) / HF generate"
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(handler=bench.run)

    train_drafter = subcommands.add_parser(
        "train-drafter", help="make prompts, generate target data, train and evaluate a DFlash drafter"
    )
    pipeline.add_arguments(train_drafter)
    train_drafter.set_defaults(handler=pipeline.run)

    loadtest = subcommands.add_parser(
        "loadtest", help="locust sweeps against ddtree modes, a naive HF server and vLLM (python -m loadtest)"
    )
    loadtest_commands = loadtest.add_subparsers(dest="loadtest_command", required=True)
    sweep = loadtest_commands.add_parser("sweep", help="locust against several servers at several concurrencies")
    from loadtest import sweep as sweep_module

    sweep_module.add_arguments(sweep)
    sweep.set_defaults(handler=sweep_module.run)
    from loadtest import soak as soak_module

    soak = loadtest_commands.add_parser(
        "soak", help="one server under a steady load for a long time, watched for leaks"
    )
    soak_module.add_arguments(soak)
    soak.set_defaults(handler=soak_module.run)

    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv[2:]  # (a sweep's report names the command that made it)
    return int(args.handler(args) or 0)


def console_main() -> int:
    """The `ddtree` command: bad input (a ValueError or a missing file, which name the fix) is one line and exit
    status 2, as argparse answers a bad flag, instead of a traceback; Ctrl-C is one line and status 130; a closed
    pipe on the output ends it quietly (status 1, as Python's own advice has it)."""
    import sys

    try:
        return main()
    except (ValueError, FileNotFoundError) as exc:
        print(f"ddtree: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what the command keeps on it (a checkpoint, finished responses) is kept
        print("\nddtree: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`ddtree generate ... | head`): stop quietly
        import os

        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush has nowhere to fail
        except (OSError, ValueError):  # stdout is not a file (captured)
            pass
        return 1


if __name__ == "__main__":
    raise SystemExit(console_main())
