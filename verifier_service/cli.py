"""``spade-verifier``: serve a target model for edge agents (verify API) and as a plain
OpenAI endpoint (target-only decoding)."""

from __future__ import annotations

from gateway.cli import run_service
from verifier_service.settings import VerifierSettings


def create_app(settings: VerifierSettings):
    """Imported on call: the app pulls in torch and the backend, which --help never needs."""
    from verifier_service.app import create_app as create_verifier_app

    return create_verifier_app(settings)


def main(argv: list[str] | None = None) -> None:
    run_service("spade-verifier", __doc__, VerifierSettings, create_app, argv)


if __name__ == "__main__":
    main()
