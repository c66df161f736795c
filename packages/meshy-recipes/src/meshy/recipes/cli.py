"""The `meshy` command line."""

import argparse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshy", description="Meshy: asynchronous RL for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the data-plane demo (rollout, inference, two trainer ranks)")
    demo.add_argument("--steps", type=int, default=5, help="weight versions to train (default 5)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from meshy.dataplane.demo import main as demo_main

        return demo_main(["--steps", str(args.steps)])
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    raise SystemExit(main())
