"""The serving benchmark end to end on the tiny model: a few requests, closed and open loop."""

import json

from bench.serving import serve
from bench.serving.workloads import ideal_hit_rate, make_workload


def test_workloads_are_seeded_and_scaled():
    mix = make_workload("mix", 50, scale=0.01, seed=3)
    assert mix == make_workload("mix", 50, scale=0.01, seed=3)
    assert {len(s.prompt_ids) for s in mix} <= {41, 20, 82} and {s.kind for s in mix} == {"4k/32", "2k/128", "8k/16"}
    shared = make_workload("shared-prefix", 3, scale=0.01, output_scale=0.5)
    assert len({s.prompt_ids[:20] for s in shared}) == 1 and len({s.prompt_ids for s in shared}) == 3
    assert [s.max_new_tokens for s in make_workload("1k1k", 2, output_scale=0.001)] == [1, 1]


def test_system_prompts_workload_and_its_ideal_hit_rate():
    specs = make_workload("system-prompts", 40, scale=0.1, seed=1)
    systems = {s.prompt_ids[:102] for s in specs}
    assert 2 <= len(systems) <= 8 and all(len(s.prompt_ids) == 102 + 26 for s in specs)
    # Each system prompt's first request misses; the later ones hit its whole blocks (6 of 16 tokens).
    expected = sum(96 for i, s in enumerate(specs) if s.prompt_ids[:102] in {t.prompt_ids[:102] for t in specs[:i]})
    assert ideal_hit_rate(specs) == expected / (40 * 128)
    assert ideal_hit_rate(make_workload("1k1k", 5, scale=0.01)) == 0.0


def read_report(out_dir):
    (path,) = out_dir.glob("*.json")
    assert path.with_suffix(".md").read_text().count("\n|") == 3   # header, rule, one row
    return json.loads(path.read_text())


def test_closed_loop_on_its_own_mesh_reports_the_gateway_stats(tiny_model_dir, tmp_path):
    assert serve.main(["--model", str(tiny_model_dir), "--workload", "shared-prefix", "--scale", "0.02",
                       "--output-scale", "0.05", "--num-requests", "6", "--concurrency", "3", "--warmup", "1",
                       "--out", str(tmp_path)]) == 0
    report = read_report(tmp_path)
    client, gateway = report["client"], report["gateway"]
    assert client["num_ok"] == 6 and client["errors"] == {}
    assert client["output_tokens_per_s"] > 0 and 0 < client["ttft_ms_p50"] <= client["e2e_ms_p99"]
    assert gateway["num_requests"] == 6 and gateway["prefix_hit_rate"] > 0
    assert gateway["plan_ms_mean"] > 0 and gateway["num_steps"] > 0


def test_open_loop_against_a_running_gateway(mesh, tmp_path):
    assert serve.main(["--target", mesh.gateway_address, "--workload", "mix", "--scale", "0.005",
                       "--output-scale", "0.1", "--num-requests", "5", "--rate", "20", "--warmup", "0",
                       "--out", str(tmp_path)]) == 0
    report = read_report(tmp_path)
    assert report["client"]["num_ok"] == 5 and report["client"]["itl_ms_p50"] > 0
    assert report["gateway"] is None


def test_sampled_specs_reach_the_gateway_seeded(mesh):
    """gpu_speed --sampling: a spec with a temperature asks for a seeded draw (the same seed, the same
    tokens); a greedy spec sets no seed."""
    import dataclasses

    import grpc

    from moe.gateway.v1 import gateway_pb2_grpc

    greedy = make_workload("1k1k", 1, scale=0.01, output_scale=0.008)[0]
    assert not serve.generate_request(greedy, "g").sampling.HasField("seed")
    sampled = dataclasses.replace(greedy, temperature=0.9, top_p=0.95, seed=11)
    request = serve.generate_request(sampled, "s")
    assert (request.sampling.seed, round(request.sampling.temperature, 3), round(request.sampling.top_p, 3)) == \
        (11, 0.9, 0.95) and request.sampling.ignore_eos
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        runs = [[t for r in stub.Generate(serve.generate_request(sampled, f"s{i}"), timeout=60) for t in r.token_ids]
                for i in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == sampled.max_new_tokens == 8
