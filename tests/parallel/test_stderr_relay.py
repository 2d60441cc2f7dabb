"""The relay that carries a multi-process run's C++ stderr: everything passes, except XLA's
coordination-service errors once the peer watch says it is ending the process."""
import subprocess
import sys

from lp_jax.parallel import stderr_relay

AGENT_ERROR = (b"E1207 09:59:39.956984   17292 coordination_service_agent.cc:288] Polled an error "
               b"from coordination service\n")
CLIENT_FATAL = (b"F1207 09:59:39.957041   17292 client.h:86] Terminating process because the JAX "
                b"distributed service detected fatal errors.\nAdditional GRPC error information\n")


def _relay(data: bytes) -> bytes:
    return subprocess.run([sys.executable, "-I", stderr_relay.__file__], input=data,
                          capture_output=True, timeout=60).stdout


def test_other_lines_pass_and_a_partial_line_is_not_lost():
    assert _relay(b"W0000 a warning\nplain text\nno newline") == b"W0000 a warning\nplain text\nno newline"


def test_coordination_errors_are_dropped_once_the_watch_ends_the_process():
    assert _relay(b"before\n" + AGENT_ERROR + CLIENT_FATAL + stderr_relay.DROP_REST
                  + b"after\n") == b"before\n"


def test_coordination_errors_nobody_claims_are_written_as_they_came():
    assert _relay(b"before\n" + AGENT_ERROR + CLIENT_FATAL) == b"before\n" + AGENT_ERROR + CLIENT_FATAL
