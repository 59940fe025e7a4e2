"""Config that tells the truth (issue 18): the policy file and the settings decoded by
msgspec with the key and its line, unknown ``TRAINGUARD_*`` variables refused with the
nearest name, ``TRAINGUARD_LOG_LEVEL``/``_FORMAT`` and the standard ``OTEL_*`` variables
honoured, one ``service.name`` per service.

What depends on process-wide state (the root logger, the global tracer provider, the
propagator the OTel API picks at import) runs in a fresh interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainguard.contract.errors import ConfigError
from trainguard.runtime import tomldecode
from trainguard.runtime.config import Settings, known_variables, load_settings
from trainguard.services.remediator.policy import PolicyError, load_policy, parse_policy


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("TRAINGUARD_", "OTEL_"))}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**clean, **env})


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_python("import sys; from trainguard.cli import main; "
                      f"sys.exit(main({list(args)!r}))", **env)


# -- the policy file ---------------------------------------------------------------------

def test_a_wrong_type_names_the_key_and_its_line_not_a_traceback(tmp_path: Path) -> None:
    """Regression: ``escalate_after = "two"`` ended in a Python traceback."""
    text = '[causes.oom]\nactions = ["restart"]\nescalate_after = "two"\n'
    with pytest.raises(PolicyError) as err:
        parse_policy(text, "p.toml")
    assert str(err.value) == ("p.toml, line 3: causes.oom.escalate_after: "
                              "Expected `int`, got `str`")
    f = tmp_path / "policy.toml"
    f.write_text(text)
    out = cli("service", "remediator", TRAINGUARD_POLICY=str(f))
    assert out.returncode == 2, out.stderr
    assert "line 3: causes.oom.escalate_after" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_key_named_in_a_comment_does_not_take_the_line() -> None:
    """Regression: the line was the first one containing the key's name, comments too."""
    text = ("# cooldown_secs was renamed cooldown_s\n"
            "[defaults]  # cooldown_secs: see above\n"
            "cooldown_s = 3\n"
            "cooldown_secs = 5\n")
    with pytest.raises(PolicyError, match=r"line 4: defaults.cooldown_secs: unknown key"):
        parse_policy(text, "p.toml")
    text = ('[causes.oom]  # escalate_after = 2 would be fine\n'
            'actions = ["restart"]   # escalate_after below\n'
            'escalate_after = -1\n')
    with pytest.raises(PolicyError, match=r"line 3: causes.oom.escalate_after: "
                                          r"Expected `int` >= 0"):
        parse_policy(text, "p.toml")


@pytest.mark.parametrize(("text", "line", "why"), [
    ('[causes.oomm]\nactions = ["restart"]\n', 1, "unknown cause 'oomm'; known: "),
    ('[causes.oom]\nactions = ["restart", "reboot"]\n', 2, "unknown action 'reboot'"),
    ('[defaults]\nescalate_unknown = 1\n', 2, "Expected `bool`, got `int`"),
    ('[defaults]\ncooldown_s = -5\n', 2, "Expected `float` >= 0"),
    ('[causes.oom]\nescalate_after = 1\n', 1, "missing required field `actions`"),
    ('[alerts]\nx = 1\n', 1, "unknown key 'alerts'"),
    ('[defaults]\ncooldown_s = \n', 2, "Invalid value"),
])
def test_bad_policies_name_key_and_line(text: str, line: int, why: str) -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(text, "p.toml")
    assert err.value.line == line and why in str(err.value), str(err.value)


def test_an_override_file_still_changes_only_what_it_names(tmp_path: Path) -> None:
    f = tmp_path / "p.toml"
    f.write_text('[defaults]\ncooldown_s = 5\n[causes.oom]\nactions = ["alert"]\n')
    base, p = load_policy(), load_policy(f)
    assert p.cooldown_s == 5 and p.restart_budget_per_hour == base.restart_budget_per_hour
    assert p.causes["oom"].actions == ("alert",) and p.causes["numeric"] == base.causes["numeric"]


def test_locate_reads_toml_not_text() -> None:
    text = ('title = "a # not a comment"\n'
            '[causes."rank_hang"]\n'
            'actions = ["dump"]\n'
            '[causes]\n'
            'oom.actions = ["restart"]\n')
    assert tomldecode.strip_comment('x = "a # b" # c') == 'x = "a # b" '
    assert tomldecode.locate(text, ("causes", "rank_hang", "actions")) == 3
    assert tomldecode.locate(text, ("causes", "oom", "actions")) == 5
    assert tomldecode.locate(text, ("causes", "rank_hang", "nothing")) == 2  # its table
    assert tomldecode.locate(text, ("elsewhere",)) == 0


# -- environment variables ---------------------------------------------------------------

def test_a_misspelt_variable_is_an_error_naming_the_nearest_name() -> None:
    """Regression: ``TRAINGUARD_CONECT_TIMEOUT`` was silently ignored."""
    with pytest.raises(ConfigError, match=r"TRAINGUARD_CONECT_TIMEOUT; did you mean "
                                          r"TRAINGUARD_CONNECT_TIMEOUT\?"):
        load_settings(Settings, env={"TRAINGUARD_CONECT_TIMEOUT": "3"})
    out = cli("status", "--redis", "redis://127.0.0.1:1/0", TRAINGUARD_CONECT_TIMEOUT="3")
    assert out.returncode == 2
    assert "did you mean TRAINGUARD_CONNECT_TIMEOUT?" in out.stderr


def test_known_names_come_from_the_settings_classes_themselves() -> None:
    # A detector threshold, the remediator's policy and the Guard's own names are known to
    # any process (one environment serves every service of `trainguard up`).
    env = {"TRAINGUARD_HANG_FLOOR": "9", "TRAINGUARD_POLICY": "", "TRAINGUARD_DISABLED": "1",
           "TRAINGUARD_JOB": "j", "TRAINGUARD_RANK_CREDENTIALS": ""}
    assert load_settings(Settings, env=env).connect_timeout == 5.0

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class NewSettings(Settings):
        stream_replicas_for_test: int = 1

    assert "TRAINGUARD_STREAM_REPLICAS_FOR_TEST" in known_variables()
    s = load_settings(NewSettings, env={"TRAINGUARD_STREAM_REPLICAS_FOR_TEST": "3"})
    assert s.stream_replicas_for_test == 3


def test_settings_are_decoded_by_type_with_the_variable_named() -> None:
    with pytest.raises(ConfigError, match=r"TRAINGUARD_MAX_DELIVER='1.5' is not a valid int"):
        load_settings(Settings, env={"TRAINGUARD_MAX_DELIVER": "1.5"})
    with pytest.raises(ConfigError, match=r"log_level='LOUD': use one of DEBUG"):
        load_settings(Settings, env={"TRAINGUARD_LOG_LEVEL": "LOUD"})
    assert load_settings(Settings, env={"TRAINGUARD_MAX_DELIVER": " 7 "}).max_deliver == 7


# -- logs --------------------------------------------------------------------------------

LOG_SOME = ("import logging; from trainguard.runtime import logs; logs.configure(); "
            "log = logging.getLogger('trainguard.t'); log.info('hidden'); "
            "log.warning('shown'); log.debug('deep')")


def test_log_level_and_json_format_come_from_the_environment() -> None:
    """Regression: ``TRAINGUARD_LOG_LEVEL`` did nothing."""
    out = run_python(LOG_SOME, TRAINGUARD_LOG_LEVEL="warning", TRAINGUARD_LOG_FORMAT="json")
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert [(r["level"], r["message"]) for r in lines] == [("WARNING", "shown")]
    out = run_python(LOG_SOME, TRAINGUARD_LOG_LEVEL="DEBUG")
    assert "hidden" in out.stderr and "deep" in out.stderr
    out = cli("status", TRAINGUARD_LOG_LEVEL="LOUD")
    assert out.returncode == 2 and "TRAINGUARD_LOG_LEVEL='LOUD'" in out.stderr


def test_log_level_after_the_sub_command_and_version() -> None:
    from trainguard.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["events", "--log-level", "debug"]).log_level == "DEBUG"
    assert parser.parse_args(["--log-level", "ERROR", "events"]).log_level == "ERROR"
    assert parser.parse_args(["events"]).log_level is None
    args = parser.parse_args(["incidents", "show", "abc", "--log-level", "WARNING"])
    assert (args.id, args.log_level) == ("abc", "WARNING")
    out = cli("--version")
    from trainguard import __version__
    assert out.returncode == 0 and out.stdout.strip() == f"trainguard {__version__}"
    out = cli("events", "--log-level", "LOUD")
    assert out.returncode == 2 and "invalid choice: 'LOUD'" in out.stderr


# -- OpenTelemetry -----------------------------------------------------------------------

SPANS = ("from trainguard.runtime import telemetry; "
         "telemetry.setup_tracing('trainguard-detector'); "
         "telemetry.service_tracer('detector').start_span('s').end(); "
         "from opentelemetry import trace; "
         "getattr(trace.get_tracer_provider(), 'shutdown', lambda: None)()")


def test_otel_service_name_and_traces_exporter_are_honoured() -> None:
    """Regression: OTEL_SERVICE_NAME and OTEL_TRACES_EXPORTER were ignored."""
    out = run_python(SPANS, OTEL_SERVICE_NAME="my-detector", OTEL_TRACES_EXPORTER="console")
    assert out.returncode == 0, out.stderr
    span = json.loads(out.stdout)
    assert span["resource"]["attributes"]["service.name"] == "my-detector"
    out = run_python(SPANS, OTEL_TRACES_EXPORTER="console")
    assert json.loads(out.stdout)["resource"]["attributes"]["service.name"] == \
        "trainguard-detector"
    out = run_python(SPANS, OTEL_TRACES_EXPORTER="none")
    assert out.returncode == 0 and out.stdout == ""
    out = run_python(SPANS, OTEL_TRACES_EXPORTER="zipkin")
    assert "OTEL_TRACES_EXPORTER='zipkin'" in out.stderr
    out = run_python(SPANS, OTEL_TRACES_EXPORTER="console", OTEL_SDK_DISABLED="true")
    assert out.returncode == 0 and out.stdout == ""


def test_otel_propagators_decide_what_goes_into_headers() -> None:
    """Regression: OTEL_PROPAGATORS was ignored (W3C trace context always)."""
    code = ("from trainguard.core import tracing; from trainguard.runtime import telemetry; "
            "telemetry.setup_tracing('t', 'none'); "
            "span = tracing.tracer().start_span('x'); from opentelemetry import trace; "
            "print(sorted(tracing.inject({}, trace.set_span_in_context(span))))")
    assert run_python(code).stdout.strip() == "['traceparent']"
    assert run_python(code, OTEL_PROPAGATORS="baggage").stdout.strip() == "[]"
    out = run_python(code, OTEL_PROPAGATORS="nosuch")
    assert out.returncode != 0 and "OTEL_PROPAGATORS='nosuch'" in out.stderr
    # A rank's publish never fails on it: W3C trace context, and a warning.
    lib = ("from trainguard.core import tracing; from opentelemetry import trace; "
           "from opentelemetry.sdk.trace import TracerProvider; "
           "span = TracerProvider().get_tracer('t').start_span('x'); "
           "print(sorted(tracing.inject({}, trace.set_span_in_context(span))))")
    out = run_python(lib, OTEL_PROPAGATORS="nosuch")
    assert out.stdout.strip() == "['traceparent']" and "using W3C trace context" in out.stderr


def test_each_service_of_one_process_has_its_own_service_name(tmp_path: Path) -> None:
    spans = tmp_path / "spans.jsonl"
    code = (f"from trainguard.runtime import telemetry; telemetry.setup_tracing('trainguard-up', "
            f"'file:{spans}', several=True)\n"
            "for name in ('detector', 'diagnoser', 'detector'):\n"
            "    telemetry.service_tracer(name).start_span(name).end()\n")
    assert run_python(code).returncode == 0
    names = [(s["name"], s["resource"]["attributes"]["service.name"])
             for s in map(json.loads, spans.read_text().splitlines())]
    assert names == [("detector", "trainguard-detector"), ("diagnoser", "trainguard-diagnoser"),
                     ("detector", "trainguard-detector")]
    spans.unlink()
    assert run_python(code, OTEL_SERVICE_NAME="prod").returncode == 0
    assert {json.loads(s)["resource"]["attributes"]["service.name"]
            for s in spans.read_text().splitlines()} == {"prod-detector", "prod-diagnoser"}
