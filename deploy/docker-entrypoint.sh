#!/bin/sh
# The image's entrypoint: `kaisa-ray` for a kaisa-ray subcommand or flag, any other program as is.
#
#   docker run IMAGE serve --host 0.0.0.0 ...   ->  kaisa-ray serve --host 0.0.0.0 ...
#   docker run IMAGE train --config FILE ...    ->  kaisa-ray train --config FILE ...
#   docker run IMAGE                            ->  kaisa-ray --help   (the image's CMD)
#   docker run IMAGE ray start --head ...       ->  ray start --head ...
#   docker run IMAGE bash                       ->  bash   (what `ray up` runs in its containers)
#
# A plain ENTRYPOINT ["kaisa-ray"] would turn the cluster launcher's `docker run ... IMAGE bash`
# into `kaisa-ray bash`, which exits at once. KubeRay sets the command of its Ray containers itself
# (bash running `ray start ...`), and so does its RayJob submitter (bash running `ray job submit`),
# so this script never runs in KubeRay's pods.
# The list of subcommands must match `kaisa-ray --help` (tests/train/test_deploy.py checks it), but for
# `head` (`kaisa-ray head start` is a head on this machine for `ray job submit`; in an image,
# `head` is the coreutils program, and KubeRay or `ray up` start the cluster's head).
set -e
case "${1:-}" in
    "" | -* | cancel | example | jobs | measure-node | plan | serve | submit | sweep | train | tune | validate)
        exec kaisa-ray "$@" ;;
esac
exec "$@"
