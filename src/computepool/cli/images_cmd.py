"""`cpool images`: the container images tenants may run, each pinned to one image id.

`publish` reads the image's id from this machine's podman unless `--digest` gives it: run it where
the image is (a node), or pass the id the nodes have (`podman image inspect --format {{.Id}} NAME`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from computepool.cli.common import fail, print_json
from computepool.cli.pool_cmd import JsonOpt, ServerOpt, TokenOpt, open_client, pool_command, say, show, table
from computepool.client.images import local_image_id
from computepool.core.images import DIGEST, parse_image


def register(app: typer.Typer) -> None:
    images = typer.Typer(
        no_args_is_help=True,
        help="Container images tenants may run: published by an admin, each pinned to one image id.",
    )
    app.add_typer(images, name="images")

    @images.command("publish")
    @pool_command
    def publish(
        image: Annotated[str, typer.Argument(help="A registry name, e.g. localhost/pybase:1.")],
        tenant: Annotated[
            list[str] | None,
            typer.Option("--tenant", help="Who may run it (repeatable); default: every tenant."),
        ] = None,
        digest: Annotated[
            str | None,
            typer.Option("--digest", help="The image id (sha256:…); default: this machine's podman's."),
        ] = None,
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Publish IMAGE to every tenant or to the ones named (admin); publishing again re-pins it."""
        name = parse_image(image, "IMAGE").canonical
        pinned = digest if digest is not None else _local_id(name)
        if not DIGEST.match(pinned):
            raise fail(f"--digest: expected sha256: and 64 hex digits, got {pinned[:80]!r}")
        with open_client(server, token) as pool:
            out = pool.publish_image(name, pinned, tenant)
        if json_out:
            print_json(out)
            return
        whom = ", ".join(out["tenants"]) if out["tenants"] is not None else "every tenant"
        say(f"image {out['name']} published to {whom}, pinned to {out['digest']}")

    @images.command("list")
    @pool_command
    def list_(server: ServerOpt = None, token: TokenOpt = None, json_out: JsonOpt = False) -> None:
        """The images you may run (admins: every published image and whom it is for)."""
        with open_client(server, token) as pool:
            items = pool.list_images()
        if json_out:
            print_json(items)
            return
        t = table(None, "image", "digest", "tenants")
        for x in items:
            whom = "all" if x["tenants"] is None else ", ".join(x["tenants"])
            t.add_row(x["name"], x["digest"][:19] + "…", whom)
        show(t)

    @images.command("unpublish")
    @pool_command
    def unpublish(
        image: Annotated[str, typer.Argument(help="The published name.")],
        server: ServerOpt = None,
        token: TokenOpt = None,
        json_out: JsonOpt = False,
    ) -> None:
        """Stop publishing IMAGE (admin): new requests for it are refused; running jobs go on."""
        with open_client(server, token) as pool:
            out = pool.unpublish_image(parse_image(image, "IMAGE").canonical)
        if json_out:
            print_json(out)
        else:
            say(f"image {out['name']} unpublished")


def _local_id(name: str) -> str:
    """The id this machine's podman has for `name`; a one-line failure when it has none."""
    found = local_image_id(name)
    if found is None:
        raise fail(f"no image {name} in the podman here: pull or load it first, or give --digest sha256:…")
    return found
