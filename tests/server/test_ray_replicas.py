"""agentrt replicas on Ray Serve (agentrt.scale.ray_app): two replicas of the tiny model under a local Ray
instance (logical CPUs, one torch thread each, no dashboard), behind the front and the program router.

Skips, saying why, where the `ray` extra is not installed (`pip install agentrt[ray]`); CI installs it."""

from __future__ import annotations

import collections
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray", reason="ray[serve] is not installed: pip install 'agentrt[ray]'")
serve = pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install 'agentrt[ray]'")

from agentrt.scale.ray_app import ROUTERS, app_builder, build_app, init_local_ray  # noqa: E402
from agentrt.server import ServerConfig  # noqa: E402
from tests.server.live import free_port  # noqa: E402

CHAT = {"model": "tiny", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "Hi there."}]}


@pytest.fixture(scope="module")
def cluster(tiny_model_path, tmp_path_factory):
    """Two replicas behind the program router on a free port; Ray stopped at the end."""
    port = free_port()
    init_local_ray(4, configure_logging=False, namespace="agentrt-test")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        db = tmp_path_factory.mktemp("ray-records") / "records.db"
        config = ServerConfig(model=str(tiny_model_path), served_model_name="tiny", db=f"sqlite:///{db}",
                              engine={"num_blocks": 128, "max_num_seqs": 8})
        serve.run(build_app(config, replicas=2, router="program", num_cpus=1, torch_threads=1),
                  name="agentrt", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def test_build_app_refuses_bad_arguments_naming_them():
    with pytest.raises(ValueError, match="unknown router 'sticky'"):
        build_app(ServerConfig(), router="sticky")
    with pytest.raises(ValueError, match="replicas"):
        build_app(ServerConfig(), replicas=0)
    with pytest.raises(ValueError, match="max_load_ratio"):
        build_app(ServerConfig(), router_kwargs={"max_load_ratio": 0.5})
    assert set(ROUTERS) == {"program", "pow2", "round-robin", "prefix"}
    app = app_builder({"replicas": "3", "router": "pow2", "torch_threads": "1"})  # `serve run ...:app_builder`
    assert type(app).__name__ == "Application"
    with pytest.raises(ValueError, match="unknown argument 'replica'"):
        app_builder({"replica": "3"})


def test_a_programs_calls_stay_on_one_replica(cluster):
    where: dict[str, set[str]] = collections.defaultdict(set)
    with httpx.Client(base_url=cluster, timeout=120) as client:
        for _turn in range(2):
            for p in range(12):
                r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Program-Id": f"prog-{p}"})
                assert r.status_code == 200, r.text
                assert r.headers["x-program-id"] == f"prog-{p}"
                where[f"prog-{p}"].add(r.headers["x-agentrt-replica"])
        for p in range(12):  # the body's program_id counts as the header does
            r = client.post("/v1/chat/completions", json={**CHAT, "program_id": f"prog-{p}"})
            assert r.status_code == 200, r.text
            where[f"prog-{p}"].add(r.headers["x-agentrt-replica"])
        assert all(len(replicas) == 1 for replicas in where.values()), where
        assert len(set().union(*where.values())) == 2  # new programs spread over both replicas (all 12 on one: 1/2048)
        # the program endpoint answers from the program's replica
        r = client.get("/v1/programs/prog-0")
        assert r.status_code == 200 and r.json()["calls_done"] == 3 and r.json()["service_s"] > 0, r.text
        assert r.headers["x-agentrt-replica"] in where["prog-0"]
        assert r.json()["replicas"] == [r.headers["x-agentrt-replica"]]
        r = client.delete("/v1/programs/prog-0")
        assert r.status_code == 200 and r.json()["state"] != "running", r.text
        # the list is every replica's, whichever replica answers it (the other replica's programs as of its last
        # sync, every 0.25 s: current within a few syncs, also on a loaded machine)
        deadline = time.monotonic() + 10
        answered_by = set()
        while True:
            r = client.get("/v1/programs", params={"limit": 1000})
            answered_by.add(r.headers["x-agentrt-replica"])
            listed = {p["id"]: p for p in r.json()["data"]}
            assert {f"prog-{p}" for p in range(12)} <= set(listed)
            done = all(listed[f"prog-{p}"]["calls_done"] == 3 for p in range(1, 12))
            if (done and len(answered_by) == 2) or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert done, {p: listed[p]["calls_done"] for p in sorted(listed)}
        # /metrics: each replica's series, labelled; the calls each replica finished are where the router sent them
        placed = collections.Counter(next(iter(v)) for v in where.values())
        deadline = time.monotonic() + 10  # the replica that answers is fresh, the others within their 1 s push
        while True:
            text = client.get("/metrics").text
            done = collections.Counter()
            for family in text_string_to_metric_families(text):
                if family.name == "agentrt:request_success":
                    for sample in family.samples:
                        if sample.name.endswith("_total"):
                            done[sample.labels["replica"]] += sample.value
            if all(done[replica] >= 3 * n for replica, n in placed.items()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert set(done) == set(placed), text[:2000]
        page = client.get("/ui")  # the live page polls these two: it shows every replica's programs
        assert page.status_code == 200 and "v1/programs?limit=200" in page.text
        assert all(done[replica] >= 3 * n for replica, n in placed.items()), (done, placed)


def test_a_responses_chain_follows_its_program(cluster):
    with httpx.Client(base_url=cluster, timeout=120) as client:
        first = client.post("/v1/responses", json={"model": "tiny", "input": "Hi.", "max_output_tokens": 4})
        assert first.status_code == 200, first.text
        home = first.headers["x-agentrt-replica"]
        prev = first.json()["id"]
        for _ in range(3):
            r = client.post("/v1/responses", json={"model": "tiny", "input": "And?", "max_output_tokens": 4,
                                                   "previous_response_id": prev})
            assert r.status_code == 200, r.text
            assert r.headers["x-agentrt-replica"] == home and r.json()["program_id"] == first.json()["program_id"]
            prev = r.json()["id"]


def test_the_openai_client_works_unchanged_and_errors_keep_their_shape(cluster):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0)
    out = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4,
                                                 temperature=0, stream=True))
    assert chunks and chunks[-1].choices == [] or chunks[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4, temperature=-1)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT["messages"], max_tokens=4)


def _kill(replica_id: str) -> None:
    actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
              if replica_id in a["name"] and "agentrt-replica" in a["name"]]
    assert len(actors) == 1, actors
    ray.kill(ray.get_actor(actors[0]["name"], namespace=actors[0]["namespace"]), no_restart=False)


def test_a_replica_killed_mid_stream_fails_only_its_call(cluster):
    with httpx.Client(base_url=cluster, timeout=120) as client:
        homes: dict[str, str] = {}  # replica -> a program living there
        for p in range(32):
            r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Program-Id": f"mid-{p}"})
            assert r.status_code == 200, r.text
            homes.setdefault(r.headers["x-agentrt-replica"], f"mid-{p}")
            if len(homes) == 2:
                break
        assert len(homes) == 2, homes
        (victim_replica, victim), (other_replica, other) = homes.items()
        body = {**CHAT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
        t0 = time.monotonic()
        with client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Program-Id": victim}) as s:
            assert s.status_code == 200 and s.headers["x-agentrt-replica"] == victim_replica
            lines = s.iter_lines()
            assert next(x for x in lines if x.startswith("data: "))  # it is streaming
            _kill(victim_replica)
            rest = list(lines)  # the stream ends (the client would time out after 120 s on a hang)
        assert time.monotonic() - t0 < 60
        errors = [x for x in rest if '"replica_failed"' in x]
        assert errors and "data: [DONE]" not in rest, rest[-3:]
        # the other replica's program is served as before
        r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Program-Id": other})
        assert r.status_code == 200 and r.headers["x-agentrt-replica"] == other_replica, r.text
        _wait_until_both_run()


def _wait_until_both_run(timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = serve.status().applications["agentrt"].deployments["agentrt-replica"]
        if status.status == "HEALTHY" and status.replica_states.get("RUNNING", 0) == 2:
            time.sleep(2)  # the front's router hears of the new replica by long poll
            return
        time.sleep(1)
    pytest.fail(f"the killed replica did not come back: {status}")


def test_every_endpoint_answers_through_the_front_as_one_server_does(cluster):
    with httpx.Client(base_url=cluster, timeout=120) as client:
        pid = {"X-Program-Id": "endpoints"}
        r = client.post("/v1/embeddings", json={"model": "tiny", "input": [[11, 12, 13, 14], [7, 8]]}, headers=pid)
        assert r.status_code == 200 and [len(d["embedding"]) for d in r.json()["data"]] == [64, 64], r.text
        r = client.post("/v1/messages", json={"model": "tiny", "max_tokens": 3,
                                              "messages": [{"role": "user", "content": "Hi."}]}, headers=pid)
        assert r.status_code == 200 and r.json()["type"] == "message" and r.json()["usage"]["output_tokens"] >= 1
        r = client.post("/v1/messages", json={"model": "tiny", "messages": []})  # Anthropic's error shape
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2}, headers=pid)
        assert r.status_code == 200 and r.json()["object"] == "text_completion"
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert client.get("/health").status_code == 200
        calls = client.get("/v1/programs/endpoints/calls").json()  # from the database the replicas share
        kinds = sorted(c["kind"] for c in calls["data"])  # one call per embedding input, as on one server
        assert kinds == ["completion", "embedding", "embedding", "messages"] and not calls["has_more"], kinds


def test_a_killed_replica_fails_only_its_calls_and_comes_back(cluster):
    with httpx.Client(base_url=cluster, timeout=120) as client:
        for _ in range(2):
            r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Program-Id": "victim"})
        victim = r.headers["x-agentrt-replica"]
        before = client.get("/v1/programs/victim").json()
        assert before["calls_done"] == 2 and before["service_s"] > 0
        time.sleep(1)  # the replica's record reaches the directory (it syncs every 0.25 s)
        _kill(victim)
        # the program's next calls go elsewhere at once (or fail with a 503 naming the cause), never hang
        t0 = time.monotonic()
        codes = []
        for _ in range(3):
            r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Program-Id": "victim"})
            codes.append(r.status_code)
            if r.status_code == 503:
                assert r.json()["error"]["code"] == "replica_failed"
            else:
                assert r.status_code == 200 and r.headers["x-agentrt-replica"] != victim, r.text
        assert codes[-1] == 200 and time.monotonic() - t0 < 60
        # its record and attained service survive its replica: the new home's PLAS counts them
        after = client.get("/v1/programs/victim").json()
        assert after["calls_done"] == 2 + codes.count(200) and after["service_s"] > before["service_s"]
        assert victim in after["replicas"] and len(after["replicas"]) == 2 and after["state"] == "running"
        # other programs keep being served, and Ray brings the replica back
        _wait_until_both_run()
        r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Program-Id": "after-restart"})
        assert r.status_code == 200, r.text


def test_a_ray_failure_is_told_by_its_cause_line():
    """`serve --replicas`'s one-line error names what failed, not the remote method's header."""
    from agentrt.scale.ray_app import _cause_line

    remote = ("ray::ProxyActor.ready() (pid=22848, ip=127.0.0.1, actor_id=3ff9)\n"
              '  File "http_util.py", line 786, in start_asgi_http_server\n    raise RuntimeError(\n'
              "OSError: [Errno 98] Address already in use\n\nThe above exception was the direct cause:\n"
              "RuntimeError: Failed to bind to address '127.0.0.1:34607'.")
    assert _cause_line(RuntimeError(remote)) == "RuntimeError: Failed to bind to address '127.0.0.1:34607'."
    assert _cause_line(TimeoutError("the controller did not answer")) == "TimeoutError: the controller did not answer"
    assert _cause_line(RuntimeError("")) == "RuntimeError"
