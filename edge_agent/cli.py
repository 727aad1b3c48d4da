"""``spade-edge``: an OpenAI-compatible endpoint on the edge that drafts locally with a small
model and streams the tokens a remote verifier accepts."""

from __future__ import annotations

from edge_agent.settings import EdgeSettings
from gateway.cli import run_service


def create_app(settings: EdgeSettings):
    """Imported on call: the app pulls in torch and the drafter, which --help never needs."""
    from edge_agent.app import create_app as create_edge_app

    return create_edge_app(settings)


def main(argv: list[str] | None = None) -> None:
    run_service("spade-edge", __doc__, EdgeSettings, create_app, argv)


if __name__ == "__main__":
    main()
