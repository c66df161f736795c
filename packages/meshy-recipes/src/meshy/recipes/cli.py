"""The `meshy` command line."""

import argparse
import gc
import os
import sys

from meshy.dataplane import SchemaError

RUN_HELP = """\
where runs go:
  Each run gets a directory RUN_DIR: runs/<name>-<stamp>/ by default (the
  recipe's run_dir, runs/ under the working directory, then its name and start
  time). It holds the recipe as run (recipe.toml), metrics.jsonl,
  reward_curve.png, tensorboard/, logs/, checkpoints/ and final_weights/ (an
  HF directory; `meshy sample RUN_DIR PROMPT` answers with it).

changing the recipe without editing it:
  meshy run --set steps=200 --set seed=1
  meshy run smollm2-135m-arithmetic-cpu --set algorithm.optim.lr=1e-5
  --set FIELD=VALUE (repeatable): VALUE is a TOML value (200, 1e-4, true,
  "none", [1, 2]; a bare word is a string), typed and checked as the file's
  own, and recorded in RUN_DIR/recipe.toml.

resuming:
  meshy run --resume RUN_DIR
  carries a stopped run on from its newest checkpoint (every
  checkpoint_every versions), with the recipe it started with (--set included).
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshy", description="Meshy: asynchronous RL for LLMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser(
        "run",
        help="run a recipe (default: the embedded CPU demo) with one torchrun",
        epilog=RUN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("recipe", nargs="?", help="a recipe TOML file or a shipped recipe's name (default: the default)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run from its last checkpoint")
    add_set(run)
    run.add_argument("--nnodes", type=int, help="nodes the run spans (the recipe's topology.nodes)")
    run.add_argument("--node-rank", type=int, help="this node's rank, 0 to nnodes - 1 (node 0 hosts the rendezvous)")
    run.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="node 0's address and a free port, on every node")
    run.add_argument("--secret-file", help="the run's secret (hex, mode 600), the same file on every node")
    inspect = commands.add_parser("inspect", help="audit a run: versions, loads, GPU grants, staleness, drops")
    inspect.add_argument("run_dir", metavar="RUN_DIR")
    commands.add_parser("recipes", help="list the shipped recipes: model, devices, mode")
    check = commands.add_parser("check", help="validate a recipe and print its topology (no GPU needed)")
    check.add_argument("recipe", help="a recipe TOML file or a shipped recipe's name")
    check.add_argument("--gpus-per-node", type=int, help="place roles on this many GPUs (default: what it needs)")
    check.add_argument("--nnodes", type=int, help="the nodes the recipe is laid out for (topology.nodes)")
    add_set(check)
    sample = commands.add_parser("sample", help="answer prompts with a run's weights, on the CPU (greedy)")
    sample.add_argument("run_dir", metavar="RUN_DIR")
    sample.add_argument("prompts", nargs="+", metavar="PROMPT", help="asked as the recipe's task asks its questions")
    sample.add_argument("--version", type=int, help="a weights version the run kept (default: its final weights)")
    sample.add_argument("--max-new-tokens", type=int, help="default: the recipe's sampling.max_new_tokens")
    sample.add_argument("--temperature", type=float, default=0.0, help="0 (the default): greedy")
    demo = commands.add_parser("demo", help="run the data-plane demo (rollout, inference, two trainer ranks)")
    demo.add_argument("--steps", type=int, default=5, help="weight versions to train (default 5)")
    try:
        code = command(parser.parse_args(argv))
    except BrokenPipeError:  # `meshy check ... | head`: the reader left; say nothing more (Python's own advice)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 1
    gc.freeze()  # the process ends here: no final collection over torch's heap at exit (~1 s of CPU)
    return code


def add_set(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--set",
        action="append",
        default=[],
        dest="overrides",
        metavar="FIELD=VALUE",
        help="change a recipe field (repeatable): --set steps=200 --set algorithm.optim.lr=1e-4",
    )


def overrides(args: argparse.Namespace) -> list:
    from meshy.recipes.recipe.overrides import parse_override

    return [parse_override(text) for text in args.overrides]


def command(args: argparse.Namespace) -> int:
    try:
        if args.command == "run":
            from meshy.recipes.launch.run import run as run_recipe
            from meshy.recipes.recipe.catalog import resolve

            return run_recipe(
                None if args.resume else str(resolve(args.recipe)),
                args.resume,
                nnodes=args.nnodes,
                node_rank=args.node_rank,
                rdzv_endpoint=args.rdzv_endpoint,
                secret_file=args.secret_file,
                overrides=overrides(args),
            )
        if args.command == "recipes":
            from meshy.recipes.recipe.catalog import listing

            print(listing())
            return 0
        if args.command == "check":
            from meshy.recipes.recipe import load_recipe
            from meshy.recipes.recipe.catalog import check_imports, check_nodes, resolve, topology
            from meshy.recipes.usercode.imports import import_beside
            from meshy.recipes.usercode.task_trial import try_task

            path = resolve(args.recipe)
            recipe = load_recipe(path, overrides(args))
            check_nodes(recipe, args.nnodes)
            import_beside(path)
            check_imports(recipe)
            notes = try_task(recipe, downloads=False)  # the task's code on a few problems, against the model
            print(topology(recipe, args.gpus_per_node))
            for note in notes:
                print(f"meshy: {note}", file=sys.stderr)
            return 0
        if args.command == "sample":
            from meshy.recipes.observe.sample import sample

            header, answers = sample(args.run_dir, args.prompts, args.version, args.max_new_tokens, args.temperature)
            print(header + "".join(f"\n\nprompt: {a.prompt}\ncompletion: {a.completion}" for a in answers))
            return 0
        if args.command == "inspect":
            from meshy.recipes.observe.inspect_run import report

            print(report(args.run_dir))
            return 0
        from meshy.dataplane.demo import main as demo_main

        return demo_main(["--steps", str(args.steps)])
    except SchemaError as e:
        print(f"meshy: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
