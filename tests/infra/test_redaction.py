"""What `redact` masks: every URL's userinfo, credential values, and a registered password's own
text where it stands alone as a token that cannot be an ordinary word of the message."""

from __future__ import annotations

import subprocess
import sys

import httpx

from branchsearch.infra.config.settings import load_settings
from branchsearch.infra.errors import public_line, redact, register_secret

from service_fixtures import CORPUS, start_uvicorn, write_corpus

MISSING = "index 'corp': Elasticsearch index 'corp-docs' does not exist at {url}"


def _external(es_url: str, index: str = "corp-docs") -> str:
    return (f'[indexes.corp]\nlexical = "elasticsearch"\nes_index = "{index}"\ndense = "none"\n'
            f'es_url = "{es_url}"\n[indexes.corp.fields]\nid = "_id"\ntitle = "title"\n'
            'text = "text"\nacl = ""\n')


def test_a_common_word_password_leaves_the_words_of_a_message_alone(tmp_path):
    """Passwords "index", "elastic", "search" and "x": the message keeps those words; only the
    URL's userinfo is masked."""
    config = tmp_path / "s.toml"
    config.write_text('milvus_uri = "http://root:search@127.0.0.1:2"\n'
                      + _external("http://elastic:index@127.0.0.1:1")
                      + '[indexes.other]\nlexical = "elasticsearch"\nes_index = "o"\n'
                        'es_url = "http://elastic:elastic@127.0.0.1:3"\n'
                        '[indexes.tiny]\nlexical = "elasticsearch"\nes_index = "t"\n'
                        'es_url = "http://u:x@127.0.0.1:4"\n')
    load_settings(config, {"index": "corp"}, read_env=False)
    line = MISSING.format(url="http://elastic:index@127.0.0.1:1")
    assert redact(line) == MISSING.format(url="http://***@127.0.0.1:1")
    assert redact("elasticsearch at http://elastic:elastic@127.0.0.1:3 is not reachable; "
                  "search the index again") == (
        "elasticsearch at http://***@127.0.0.1:3 is not reachable; search the index again")
    assert redact("milvus at http://root:search@127.0.0.1:2: search failed (x of index)") == \
        "milvus at http://***@127.0.0.1:2: search failed (x of index)"
    assert redact("password=index token: search") == "password=*** token: ***"


def test_a_password_inside_a_message_is_still_masked():
    """A password that cannot be a word of the message (it mixes letters with digits or
    symbols, or is long) is masked wherever it stands as a token of its own."""
    for secret in ("hunter2", "Zq7@Word-x1", "ElasticPass", "correcthorsebatterystaple"):
        register_secret(secret)
        for shown in (f"auth failed for {secret}", f"'{secret}' was refused", f'{{"p":"{secret}"}}',
                      f"user elastic/{secret}: denied", f"({secret})."):
            assert secret not in redact(shown), shown
            assert "***" in redact(shown), shown
    assert redact("hunter2's key and hunter22") == "***'s key and hunter22"  # a token, not a part


def test_a_url_with_percent_encoded_userinfo_is_masked_whole(tmp_path):
    config = tmp_path / "s.toml"
    config.write_text(_external("http://es%40corp:Pa%2Fss%3A9@127.0.0.1:1"))
    load_settings(config, {"index": "corp"}, read_env=False)
    assert redact("GET http://es%40corp:Pa%2Fss%3A9@127.0.0.1:1/corp-docs/_search failed") == \
        "GET http://***@127.0.0.1:1/corp-docs/_search failed"
    assert redact("rejected credentials es@corp:Pa/ss:9 and Pa%2Fss%3A9") == \
        "rejected credentials es@corp:*** and ***"
    assert redact("https://user@host.example:9200/x") == "https://***@host.example:9200/x"


def test_a_non_ascii_password_is_masked(tmp_path):
    config = tmp_path / "s.toml"
    config.write_text(_external("http://elastic:Пароль-2024@127.0.0.1:1")
                      + '[indexes.latin]\nlexical = "elasticsearch"\nes_index = "l"\n'
                        'es_url = "http://elastic:p%C3%A4ssw%C3%B6rd@127.0.0.1:5"\n')
    load_settings(config, {"index": "corp"}, read_env=False)
    assert redact("at http://elastic:Пароль-2024@127.0.0.1:1: 401 for Пароль-2024") == \
        "at http://***@127.0.0.1:1: 401 for ***"
    assert redact("at http://elastic:pässwörd@127.0.0.1:5 and http://elastic:p%C3%A4ssw%C3%B6rd"
                  "@127.0.0.1:5") == "at http://***@127.0.0.1:5 and http://***@127.0.0.1:5"
    assert "Пароль" not in public_line("auth: Пароль-2024 refused")


def test_errors_of_an_index_whose_password_is_a_common_word_read_whole(tmp_path, es_url,
                                                                       caplog):
    """`indexes`, `retrieve` and the service's 503 on an external index whose es_url password
    is "index", and whose Elasticsearch index does not exist: the lines keep the word "index"
    (not "*** 'corp': Elasticsearch *** 'corp-docs'") and still hide the password; the
    caller's 503 says "open this index", the server log the whole line."""
    url = es_url.replace("://", "://elastic:index@")
    config = tmp_path / "s.toml"
    config.write_text(_external(url, "no-such-index"))
    cli = [sys.executable, "-m", "branchsearch.orchestrator.cli"]
    home = ["--config", str(config), "--home", str(tmp_path / "home")]
    listed = subprocess.run([*cli, "indexes", *home], capture_output=True, text=True, timeout=300)
    assert listed.returncode == 1, listed
    hidden = es_url.replace("://", "://***@")
    said = f"index 'corp': Elasticsearch index 'no-such-index' does not exist at {hidden}"
    assert said in listed.stdout, listed.stdout
    asked = subprocess.run([*cli, "retrieve", "harbor", "--index", "corp", *home],
                           capture_output=True, text=True, timeout=300)
    assert (asked.returncode, asked.stdout, asked.stderr) == (2, "", f"error: {said}\n")

    from branchsearch.orchestrator.service import deploy as service
    from branchsearch.infra.ingest.pipeline import ingest

    settings = load_settings(config, {"home": tmp_path / "home", "index": "local",
                                      "branches": 1}, read_env=False)
    ingest(write_corpus(tmp_path / "c.jsonl", CORPUS[:2]), settings, dense=False)
    state = service.local_state(settings, executor="local")
    server = start_uvicorn(service.create_app(state), state)
    try:
        answer = httpx.post(f"{server.url}/v1/search", timeout=120,
                            json={"question": "Harbor Festival", "index": "corp"})
        assert answer.status_code == 503, answer.text
        assert answer.json()["detail"] == ("the server's settings do not let it open this "
                                           "index; its operator must fix them (the server log "
                                           "says how)"), answer.text
        assert said in caplog.text, caplog.text  # the server log
        assert ":index@" not in caplog.text + answer.text
    finally:
        server.stop()
        state.searcher.target.close()
