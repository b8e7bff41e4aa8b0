"""Where the kvwatch container's image comes from in the generated manifests
(kvwatch/mixin/manifests.py): the deploy config's `image`, or with none named
(the default) a file beside each kustomization that runs kvwatch."""

from __future__ import annotations

from kvwatch.mixin.config import DeploySettings

# No registry serves kvwatch under a default name, and a native sidecar whose image
# cannot be pulled keeps vLLM from starting. So with no image named (the default) a
# kustomization that runs kvwatch reads it from IMAGE_FILE beside it: a build without
# that file fails naming it, and a file applied without kustomize has no image, which
# the API server refuses (docs/deploy.md, "A default that cannot keep vLLM from starting").
IMAGE_FILE = "kvwatch-image.env"
IMAGE_CONFIG_MAP = "kvwatch-image"
# Marks the objects whose kvwatch container takes the image: a user's other Deployments are left alone.
IMAGE_ANNOTATION = "kvwatch/image-from"


def image_field(s: DeploySettings) -> dict:
    return {"image": s.image} if s.image else {}


def marked(metadata: dict, s: DeploySettings) -> dict:
    """An object's metadata, with IMAGE_ANNOTATION where its kvwatch container's image comes from IMAGE_FILE."""
    return metadata if s.image else {**metadata, "annotations": {IMAGE_ANNOTATION: IMAGE_FILE}}


def image_line(s: DeploySettings) -> str:
    if s.image:
        return f"the image `{s.image}`, as the deploy config names it."
    return (f"the image: no registry serves kvwatch under a default name, so write the one you pushed into\n"
            f"  `{IMAGE_FILE}` beside the Component's kustomization, as one line\n"
            f"  `image=REGISTRY/kvwatch:TAG`. Without that file the build fails naming it, and a vLLM\n"
            f"  pod never waits on an image nobody can pull (docs/deploy.md).")


def image_requirement(s: DeploySettings, kind: str, key: str) -> dict:
    """The kustomization fields that set the `kvwatch` container's image in the
    `key` list (containers or initContainers) of each `kind` object marked with
    IMAGE_ANNOTATION, from IMAGE_FILE's `image=` line; none when the image is named."""
    if s.image:
        return {}
    return {
        "configMapGenerator": [{
            "name": IMAGE_CONFIG_MAP, "envs": [IMAGE_FILE],
            # Read by the replacement, never applied.
            "options": {"annotations": {"config.kubernetes.io/local-config": "true"}},
        }],
        "replacements": [{
            "source": {"kind": "ConfigMap", "name": IMAGE_CONFIG_MAP, "fieldPath": "data.image"},
            "targets": [{
                "select": {"kind": kind, "annotationSelector": f"{IMAGE_ANNOTATION}={IMAGE_FILE}"},
                "fieldPaths": [f"spec.template.spec.{key}.[name=kvwatch].image"],
                "options": {"create": True},
            }],
        }],
    }
