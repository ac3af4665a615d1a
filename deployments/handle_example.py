"""Calling the app from Python through a Serve handle (no HTTP).

    python -m deployments.handle_example              # serves the embedded default model here, then calls it
    python -m deployments.handle_example --connect    # calls an app already running (`serve run ray_config.yaml`)

`serve.get_app_handle(name)` returns the ingress deployment's handle; its `generate` answers the final
`ddtree.outputs.RequestOutput` (text, token_ids, finish_reason, stats with the acceptance lengths) and
`generate_stream`, called through `handle.options(stream=True)`, yields the incremental outputs (`new_text`,
`new_token_ids`).
"""

from __future__ import annotations

import argparse


def run_example(app_name: str = "ddtree", max_tokens: int = 32) -> list:
    """The two calls of the example; returns [the final output of `generate`, the streamed outputs]."""
    from ray import serve

    from ddtree import SamplingParams

    handle = serve.get_app_handle(app_name)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)

    final = handle.generate.remote("The capital of France is", params).result()
    print(
        f"generate: {final.text!r} ({final.finish_reason}, mean acceptance length {final.stats.mean_acceptance_length})"
    )

    streamed = []
    print("generate_stream: ", end="", flush=True)
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    for output in handle.options(stream=True).generate_stream.remote(messages=messages, params=params):
        print(output.new_text, end="", flush=True)
        streamed.append(output)
    print()
    return [final, streamed]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connect", action="store_true", help="use the app of a running Ray cluster")
    parser.add_argument("--app", default="ddtree", help="application name (ray_config.yaml: ddtree)")
    args = parser.parse_args(argv)

    import ray
    from ray import serve

    if args.connect:
        ray.init(address="auto")
    else:
        from deployments.app import build_app

        serve.run(build_app({}), name=args.app, route_prefix="/")
    run_example(args.app)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
