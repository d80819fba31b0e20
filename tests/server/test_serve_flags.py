"""The `agentrt serve` flags a vLLM user brings from `vllm serve`: the positional model, CORS
(`--allowed-origins` and friends; preflights need no API key), `--seed`, `--[no-]enable-prefix-caching`,
`--chat-template` (a file or the template itself, used for every chat prompt), `--root-path`,
`--ssl-keyfile` / `--ssl-certfile` and `--disable-uvicorn-access-log`. Bad values fail before the
model loads with one line and exit 2."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import threading
import time

import httpx
import jinja2
import pytest
import uvicorn

import agentrt.server
from agentrt.command import main as cli
from agentrt.engine.config import EngineConfig
from agentrt.server import ServerConfig, create_app
from tests.server.live import free_port, live_server, tiny_config
from tests.test_cli import one_line_error

ORIGIN = "http://localhost:3000"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
KEY = {"Authorization": "Bearer k1"}


@pytest.fixture
def served(monkeypatch):
    """What the CLI hands `agentrt.server.serve`: the config, host, port, log level and uvicorn options."""
    got: dict = {}

    def serve(config, host, port, log_level, **options):
        got.update(config=config, host=host, port=port, log_level=log_level, **options)
        return 0

    monkeypatch.setattr(agentrt.server, "serve", serve)
    return got


@pytest.fixture
def no_load(monkeypatch):
    """The real `serve`, stopped before it builds the app (and so before any model loads)."""
    monkeypatch.setattr(agentrt.server, "create_app", lambda *a, **k: pytest.fail("the app was built"))


# --- the command line -------------------------------------------------------------------------
def test_positional_model_as_vllm_serve(served):
    assert cli(["serve", "some/model"]) == 0
    assert served["config"].model == "some/model"
    assert cli(["serve", "--model", "other/model"]) == 0
    assert served["config"].model == "other/model"
    assert cli(["serve", "same/model", "--model", "same/model"]) == 0
    assert served["config"].model == "same/model"
    assert cli(["serve"]) == 0
    assert served["config"].model is None


def test_engine_flags_reach_the_engine_config(served, tmp_path):
    assert cli(["serve", "m", "--seed", "7", "--no-enable-prefix-caching"]) == 0
    engine = served["config"].engine
    assert engine["seed"] == 7 and engine["enable_prefix_caching"] is False
    config = EngineConfig(**engine)  # the keys are EngineConfig's own fields
    assert config.seed == 7 and config.enable_prefix_caching is False
    assert cli(["serve", "m", "--enable-prefix-caching"]) == 0
    assert served["config"].engine["enable_prefix_caching"] is True
    (tmp_path / "adapter_config.json").write_text("{}")
    assert cli(["serve", "m", "--generation-config", "vllm", "--override-generation-config", '{"top_k": 5}',
                "--lora-modules", f"a={tmp_path}", "--max-loras", "2"]) == 0
    engine = served["config"].engine
    assert engine["generation_config"] == "vllm" and engine["override_generation_config"] == {"top_k": 5}
    assert engine["max_loras"] == 2 and served["config"].lora_modules == [f"a={tmp_path}"]
    assert cli(["serve", "m"]) == 0  # unset: the engine's defaults
    assert "seed" not in served["config"].engine and "enable_prefix_caching" not in served["config"].engine
    assert "kv_host_gib" not in served["config"].engine and "kv_disk_dir" not in served["config"].engine
    assert cli(["serve", "m", "--kv-host-gib", "2", "--kv-host-quantization", "int8", "--kv-disk-dir", str(tmp_path),
                "--kv-disk-gib", "0.5"]) == 0
    config = EngineConfig(**served["config"].engine)
    assert (config.kv_host_gib, config.kv_host_quantization, config.kv_disk_dir, config.kv_disk_gib) == (
        2.0, "int8", str(tmp_path), 0.5)


def test_cors_flags(served):
    assert cli(["serve", "m"]) == 0
    c = served["config"]
    assert c.allowed_origins is None and c.allowed_methods == ["*"] and c.allowed_headers == ["*"]
    assert c.allow_credentials is False
    assert cli(["serve", "m", "--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods", '["GET", "POST"]',
                "--allowed-headers", '["Authorization"]', "--allow-credentials"]) == 0
    c = served["config"]
    assert c.allowed_origins == [ORIGIN] and c.allowed_methods == ["GET", "POST"]
    assert c.allowed_headers == ["Authorization"] and c.allow_credentials is True


def test_chat_template_from_a_file_or_inline(served, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert cli(["serve", "m", "--chat-template", str(path)]) == 0
    assert served["config"].chat_template == TEMPLATE
    assert cli(["serve", "m", "--chat-template", TEMPLATE]) == 0
    assert served["config"].chat_template == TEMPLATE
    assert cli(["serve", "m"]) == 0
    assert served["config"].chat_template is None


def test_uvicorn_flags(served, tmp_path):
    assert cli(["serve", "m"]) == 0
    assert (served["root_path"], served["ssl_keyfile"], served["ssl_certfile"]) == ("", None, None)
    assert served["access_log"] is True
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    assert cli(["serve", "m", "--host", "0.0.0.0", "--port", "9001", "--root-path", "/llm", "--ssl-keyfile", str(key),
                "--ssl-certfile", str(cert), "--disable-uvicorn-access-log"]) == 0
    assert (served["host"], served["port"], served["root_path"]) == ("0.0.0.0", 9001, "/llm")
    assert (served["ssl_keyfile"], served["ssl_certfile"], served["access_log"]) == (str(key), str(cert), False)


@pytest.mark.parametrize("args, needles", [
    (["a/model", "--model", "b/model"], ["'a/model'", "'b/model'"]),
    (["--seed", "-1"], ["--seed", "-1"]),
    (["--allowed-origins", ORIGIN], ["--allowed-origins", ORIGIN]),
    (["--allowed-origins", '"*"'], ["--allowed-origins", '"*"']),
    (["--allowed-methods", '["GET", 1]'], ["--allowed-methods"]),
    (["--allowed-headers", "[x"], ["--allowed-headers", "[x"]),
    (["--chat-template", "/no/such/template.jinja"], ["/no/such/template.jinja"]),
    (["--chat-template", "{% for m in messages %}{{ m }}"], ["does not compile", "endfor"]),
    (["--chat-template", "{{ messages[0] }"], ["does not compile", "'}'"]),
    (["--root-path", "llm"], ["--root-path", "'llm'"]),
    (["--override-generation-config", "[1]"], ["--override-generation-config", "[1]"]),
    (["--lora-modules", "plain"], ["--lora-modules", "'plain'"]),
    (["--ssl-certfile", __file__], ["--ssl-keyfile", "both or neither"]),
    (["--ssl-keyfile", "/no/key.pem", "--ssl-certfile", __file__], ["--ssl-keyfile", "/no/key.pem"]),
    (["--ssl-keyfile", __file__, "--ssl-certfile", "/no/cert.pem"], ["--ssl-certfile", "/no/cert.pem"]),
    (["--kv-disk-gib", "1"], ["kv_disk_gib", "kv_disk_dir"]),
    (["--kv-host-gib", "1", "--kv-host-quantization", "fp4"], ["kv_host_quantization", "'fp4'"]),
    (["--kv-host-gib", "-1"], ["kv_host_gib", "-1"]),
], ids=["two-models", "seed", "origins-not-json", "origins-not-list", "methods-not-strings", "headers-bad-json",
        "template-missing-file", "template-unclosed", "template-syntax", "root-path", "genconf-not-object",
        "lora-modules-no-path", "ssl-half", "ssl-no-key",
        "ssl-no-cert", "kv-disk-gib-no-dir", "kv-host-quantization", "kv-host-gib-negative"])
def test_bad_values_fail_before_the_model_loads(args, needles, no_load, capsys):
    assert cli(["serve", *args]) == 2
    one_line_error(capsys, *needles)


def test_server_config_checks_its_cors_fields():
    with pytest.raises(ValueError, match="allowed_origins must be a list of strings"):
        ServerConfig(allowed_origins="*")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allowed_headers must be a list of strings"):
        ServerConfig(allowed_headers=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allow_credentials must be a bool"):
        ServerConfig(allow_credentials="yes")  # type: ignore[arg-type]


def test_server_config_reads_templates_as_transformers_does():
    long = "{# " + "x" * 5000 + " #}" + TEMPLATE  # too long for a file name: the template itself
    assert ServerConfig(chat_template=long).chat_template == long
    loop = "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
    assert ServerConfig(chat_template=loop).chat_template == loop  # transformers allows loop controls


def key_and_cert(folder, password: bytes | None = None) -> tuple[str, str]:
    """A self-signed certificate and its private key (encrypted with `password`), as PEM files in `folder`."""
    pytest.importorskip("cryptography")
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    crypt = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    tag = "encrypted-" if password else ""
    key_file, cert_file = folder / f"{tag}key.pem", folder / f"{tag}cert.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, crypt))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_file), str(cert_file)


def test_serve_hands_its_options_to_uvicorn(monkeypatch, tmp_path, tiny_model_path):
    configs: list[uvicorn.Config] = []
    monkeypatch.setattr(agentrt.server, "create_app", lambda config: object())
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: configs.append(self.config))
    config = ServerConfig(model=str(tiny_model_path), db="none")
    assert agentrt.server.serve(config, "127.0.0.1", 0) == 0
    c = configs[-1]
    assert (c.root_path, c.ssl_keyfile, c.ssl_certfile, c.access_log) == ("", None, None, True)
    key, cert = key_and_cert(tmp_path)
    assert agentrt.server.serve(config, "127.0.0.1", 0, root_path="/llm", ssl_keyfile=key, ssl_certfile=cert,
                                access_log=False) == 0
    c = configs[-1]
    assert (c.root_path, c.ssl_keyfile, c.ssl_certfile, c.access_log) == ("/llm", key, cert, False)


def test_https_files_that_do_not_load_fail_before_the_model_loads(tmp_path, no_load, capsys):
    """uvicorn loads the pair once the model has loaded (a bad pair was a traceback then; an encrypted key, a
    password prompt on the terminal): they are loaded first."""
    key, cert = key_and_cert(tmp_path)
    locked_key, locked_cert = key_and_cert(tmp_path, password=b"secret")
    for args, needles in [
        ([key, cert.replace("cert", "nothing")], ["--ssl-certfile", "is not a file"]),
        ([cert, cert], ["--ssl-certfile", "--ssl-keyfile", "do not load as a certificate and its private key"]),
        ([key, locked_cert], ["--ssl-certfile", "do not load"]),  # the key is not the certificate's
        ([locked_key, locked_cert], ["--ssl-keyfile", "is encrypted"]),
    ]:
        assert cli(["serve", "--ssl-keyfile", args[0], "--ssl-certfile", args[1]]) == 2
        one_line_error(capsys, *needles)


# --- CORS -------------------------------------------------------------------------------------
def test_no_cors_without_allowed_origins(tiny_model_path):
    from starlette.testclient import TestClient

    c = TestClient(create_app(tiny_config(tiny_model_path)))  # not entered: no lifespan, no model; /version needs none
    r = c.get("/version", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and not _cors_headers(r)
    r = c.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 405 and not _cors_headers(r)


def _cors_headers(r: httpx.Response) -> list[str]:
    return [k for k in r.headers if k.lower().startswith("access-control-")]


@pytest.fixture(scope="module")
def srv(tiny_model_path):
    """CORS for one origin, API keys, and a chat template of our own."""
    config = tiny_config(tiny_model_path, served_model_name="tiny", api_keys=["k1"], allowed_origins=[ORIGIN],
                         chat_template=TEMPLATE)
    with live_server(config) as s:
        yield s


def test_preflight_from_an_allowed_origin_needs_no_key(http):
    r = http.options("/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-program-id"})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    allowed = {h.strip() for h in r.headers["access-control-allow-headers"].lower().split(",")}
    assert {"authorization", "content-type", "x-program-id"} <= allowed


def test_preflight_from_another_origin_is_refused(http):
    r = http.options("/v1/chat/completions", headers={"Origin": "http://evil.example",
                                                      "Access-Control-Request-Method": "POST"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_requests_still_need_a_key(http):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}, headers={"Origin": ORIGIN})
    assert r.status_code == 401
    assert r.headers["access-control-allow-origin"] == ORIGIN  # the browser may read why
    assert http.get("/v1/models").status_code == 401


def test_a_browser_reads_the_program_id(http):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1},
                  headers={"Origin": ORIGIN, **KEY})
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN and r.headers["x-program-id"]
    exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
    assert {"x-program-id", "x-thread-id"} <= exposed
    r = http.get("/v1/models", headers={"Origin": "http://evil.example", **KEY})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# --- the chat template ------------------------------------------------------------------------
def test_the_chat_template_renders_every_chat_prompt(srv, http, tiny_model_path):
    from transformers import AutoTokenizer

    tok = srv.state.runtime.tokenizer
    text = jinja2.Template(TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True)
    assert text.startswith("<|system|>Be brief.\n<|user|>What is 2 + 2?\n")
    expected = tok(text, add_special_tokens=False)["input_ids"]
    model_own = AutoTokenizer.from_pretrained(tiny_model_path).apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                                   tokenize=False)
    assert tok(model_own, add_special_tokens=False)["input_ids"] != expected
    r = http.post("/tokenize", json={"messages": MESSAGES}, headers=KEY)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expected
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}, headers=KEY)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len(expected)


# --- HTTPS, root path, access log: serve() end to end -----------------------------------------
def _self_signed(tmp_path) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1, written as PEM files."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = tmp_path / "key.pem", tmp_path / "cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


@pytest.mark.parametrize("access_log", [True, False], ids=["access-log", "no-access-log"])
def test_serve_over_https_under_a_root_path(access_log, tiny_model_path, tmp_path, monkeypatch, capfd):
    key, cert = _self_signed(tmp_path)
    servers: list[uvicorn.Server] = []
    run = uvicorn.Server.run

    def keep(self, *a, **k):
        servers.append(self)
        return run(self, *a, **k)

    monkeypatch.setattr(uvicorn.Server, "run", keep)
    port = free_port()
    options = {"root_path": "/llm", "ssl_keyfile": key, "ssl_certfile": cert, "access_log": access_log}
    args = (tiny_config(tiny_model_path), "127.0.0.1", port, "info")
    thread = threading.Thread(target=agentrt.server.serve, args=args, kwargs=options, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 120
        while not (servers and servers[0].started):
            assert thread.is_alive() and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.05)
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=ssl.create_default_context(cafile=cert),
                          timeout=30) as c:
            r = c.get("/v1/models", headers={"Origin": ORIGIN})  # as a proxy that strips /llm sends it
            assert r.status_code == 200 and r.json()["data"][0]["id"] == tiny_model_path.name
            assert not _cors_headers(r)
            r = c.get("/")  # the live page's redirect keeps the prefix the browser sees
            assert r.status_code in (302, 307) and r.headers["location"] == "/llm/ui"
        with pytest.raises(httpx.HTTPError):  # TLS only
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    finally:
        if servers:
            servers[0].should_exit = True
        thread.join(60)
    out = capfd.readouterr().out
    assert f"listening on https://127.0.0.1:{port}" in out
    assert ('"GET /llm/v1/models HTTP/1.1" 200' in out) == access_log, out  # uvicorn's line names the full path
