#!/usr/bin/env bash
# build-image.sh - builds Kiln's guest image: kernel, initramfs and root filesystem.
#
# The image is cached outside the checkout in $KILN_IMAGE_CACHE (default /var/cache/kiln/images)
# under <hash>/, where <hash> is the SHA-256 of the recipe: this script, the package list, the
# initramfs /init, the root filesystem overlay and kiln-agent's sources. A build writes into a
# temporary directory and renames it into place, then writes the marker `.complete` last, so a
# directory with the marker is always whole; a second run prints the paths and exits at once.
#
#   build-image.sh              builds if needed, prints the paths of the image's files
#   build-image.sh --print-env  the same as KILN_GUEST_*=... lines (for `eval` or an env file)
#   build-image.sh --hash       prints only the recipe hash (no build)
#   build-image.sh --prune      removes cached images of other recipes and unused base tarballs,
#                               but never one a kiln-node pinned: a file `.kiln-pin-<node>` in
#                               its directory, kept while a snapshot or a VM of that node's
#                               uses the image (node/images.h; a removed node's pins are the
#                               operator's to delete)
#   build-image.sh --variant codeint [option]
#                               the same for the code interpreter's image (code-interpreter-v1):
#                               the base's recipe plus codeint/ (its packages.txt, its rootfs
#                               overlay with the worker server.py, the inittab line starting it),
#                               hashed with it; --print-env prints KILN_GUEST_CODEINT_ROOTFS and
#                               KILN_GUEST_CODEINT_HASH. The base's --print-env builds it too and
#                               appends those lines, so `make run` and the tests get both.
#
# KILN_GUEST_APT_MIRROR (config guest_apt_mirror, default http://deb.debian.org/debian) is the
# operator's Debian mirror: the build fetches from it and the image's /etc/apt/sources.list names
# it (its security updates from the same URL with "-security" appended, unless
# KILN_GUEST_APT_SECURITY_MIRROR says otherwise). Both are part of the recipe hash. Nothing of the
# host's own apt configuration goes into the image.
#
# The kernel is the versioned package that linux-image-cloud-amd64 depends on, fetched with
# `apt-get download` and unpacked with `dpkg -x` (never installed on the host). The root
# filesystem is `mmdebstrap --variant=essential` of bookworm plus packages.txt, turned into ext4
# with `mkfs.ext4 -d` (nothing is mounted). docs/guest-image.md describes the result.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${KILN_IMAGE_CACHE:-/var/cache/kiln/images}
suite=bookworm
apt_mirror=${KILN_GUEST_APT_MIRROR:-http://deb.debian.org/debian}
apt_mirror=${apt_mirror%/}
apt_security_mirror=${KILN_GUEST_APT_SECURITY_MIRROR:-$apt_mirror-security}
apt_security_mirror=${apt_security_mirror%/}
mirrors=(
	"deb $apt_mirror $suite main"
	"deb $apt_mirror $suite-updates main"
	"deb $apt_security_mirror $suite-security main"
)
# Kernel command line for a reliable boot under TCG (RECIPES.md: the TSC calibration hang).
cmdline="console=ttyS0 quiet lpj=4000000 tsc_early_khz=2000000 tsc=reliable panic=-1 root=/dev/vda rootfstype=ext4 rw"
# The virtio modules the initramfs loads, in dependency order, then the optional vsock ones.
modules=(virtio_ring virtio virtio_mmio virtio_console failover net_failover virtio_net virtio_blk
	 virtio_balloon vsock vmw_vsock_virtio_transport_common vmw_vsock_virtio_transport)
# Free space left in rootfs.ext4 beyond its content (MiB); the VMM grows each sandbox's layer.
rootfs_slack_mib=128

mode=paths
variant=""
if [ "${1:-}" = --variant ]; then
	[ "${2:-}" = codeint ] || { echo "build-image.sh: unknown variant '${2:-}'" >&2; exit 2; }
	variant=$2
	shift 2
fi
case "${1:-}" in
"") ;;
--print-env) mode=env ;;
--hash) mode=hash ;;
--prune) mode=prune ;;
-h | --help)
	sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
	exit 0
	;;
*)
	echo "build-image.sh: unknown option '$1'" >&2
	exit 2
	;;
esac

die() {
	echo "build-image.sh: $*" >&2
	exit 1
}

# The recipe: every file whose change must give a new image, hashed by path and content.
recipe_hash() {
	(
		cd "$here"
		find build-image.sh add-user.sh packages.txt initramfs-init agent_proto.h agent_proto.c \
			agent rootfs -type f ! -name '*~' -print0 | LC_ALL=C sort -z |
			while IFS= read -r -d '' f; do
				printf '%s\0' "$f"
				sha256sum <"$f"
			done
		if [ -n "$variant" ]; then
			printf 'variant %s\n' "$variant"
			find "$variant" -type f ! -name '*~' -print0 | LC_ALL=C sort -z |
				while IFS= read -r -d '' f; do
					printf '%s\0' "$f"
					sha256sum <"$f"
				done
		fi
		printf '%s\n' "${mirrors[@]}"
	) | sha256sum | cut -c1-64
}

hash=$(recipe_hash)
out=$cache/$hash

print_result() {
	local kver
	kver=$(cat "$out/kernel-release")
	if [ "$mode" = env ] && [ -n "$variant" ]; then
		echo "KILN_GUEST_CODEINT_ROOTFS=$out/rootfs.ext4"
		echo "KILN_GUEST_CODEINT_HASH=$hash"
	elif [ "$mode" = env ]; then
		echo "KILN_GUEST_KERNEL=$out/vmlinuz"
		echo "KILN_GUEST_INITRD=$out/initrd.img"
		echo "KILN_GUEST_ROOTFS=$out/rootfs.ext4"
		echo "KILN_GUEST_IMAGE_HASH=$hash"
		echo "KILN_GUEST_KERNEL_RELEASE=$kver"
		echo "KILN_GUEST_CMDLINE=\"$cmdline\""
		echo "KILN_GUEST_AGENT_PORT=kiln.agent"
		# The code interpreter's image, built (or found) the same way.
		bash "$here/build-image.sh" --variant codeint --print-env
	else
		echo "$out/vmlinuz"
		echo "$out/initrd.img"
		echo "$out/rootfs.ext4"
		echo "$out/manifest.json"
	fi
}

if [ "$mode" = hash ]; then
	echo "$hash"
	exit 0
fi
if [ "$mode" = prune ]; then
	[ -d "$cache" ] || exit 0
	keep_base=""
	[ -f "$out/base-key" ] && keep_base=$(cat "$out/base-key")
	keep_hash=""
	if [ -z "$variant" ]; then
		keep_hash=$(bash "$here/build-image.sh" --variant codeint --hash)
		vout=$cache/$keep_hash
		[ -f "$vout/base-key" ] && keep_base="$keep_base $(cat "$vout/base-key")"
	fi
	for d in "$cache"/*/ "$cache"/.build-*/; do
		[ -d "$d" ] || continue
		h=$(basename "$d")
		h=${h#.build-}
		h=${h%.*}
		[ "$h" = "$hash" ] && continue
		[ "$h" = "$keep_hash" ] && continue
		pins=$(find "$d" -maxdepth 1 -name '.kiln-pin-*' -printf '%f ' 2>/dev/null || true)
		if [ -n "$pins" ]; then
			echo "build-image.sh: keeping '$d': in use (${pins% })" >&2
			# its base tarball too: a build of it again needs it
			[ -f "$d/base-key" ] && keep_base="$keep_base $(cat "$d/base-key")"
			continue
		fi
		# Skip anything a build holds the lock of right now.
		exec 8>"$cache/.lock-$h"
		if flock -n 8; then
			echo "build-image.sh: removing '$d'" >&2
			rm -rf "$d"
			rm -f "$cache/.lock-$h"
		fi
		exec 8>&-
	done
	for b in "$cache"/base-*.tar; do
		[ -f "$b" ] || continue
		k=$(basename "$b" .tar)
		k=${k#base-}
		case " $keep_base " in *" $k "*) continue ;; esac
		echo "build-image.sh: removing '$b'" >&2
		rm -f "$b"
	done
	exit 0
fi
if [ -f "$out/.complete" ]; then
	print_result
	exit 0
fi

[ "$(id -u)" -eq 0 ] || die "needs root (mmdebstrap, dpkg -x ownership, mkfs.ext4 -d)"
for tool in apt-get apt-cache dpkg mmdebstrap mkfs.ext4 cpio gzip gcc sha256sum flock; do
	command -v "$tool" >/dev/null || die "missing tool '$tool' (run scripts/deps)"
done

mkdir -p "$cache"
# One builder per hash at a time; others wait, then find the result complete.
exec 9>"$cache/.lock-$hash"
flock 9
if [ -f "$out/.complete" ]; then
	print_result
	exit 0
fi

start=$(date +%s)
work=$(mktemp -d "$cache/.build-$hash.XXXXXX")
cleanup() { rm -rf "$work"; }
trap cleanup EXIT
log() { echo "build-image.sh: $*" >&2; }
chmod 755 "$work"

# 1. Kernel: the versioned package behind the linux-image-cloud-amd64 metapackage.
kpkg=$(apt-cache depends linux-image-cloud-amd64 | sed -n 's/^ *Depends: \(linux-image-[0-9].*-cloud-amd64\)$/\1/p' | head -1)
[ -n "$kpkg" ] || die "cannot resolve linux-image-cloud-amd64 (apt-get update?)"
log "kernel package '$kpkg'"
mkdir -p "$work/deb" "$work/kernel"
(cd "$work/deb" && apt-get download -q "$kpkg" busybox-static 2>&1 | grep -v '^W: Download is performed unsandboxed' >&2 || true)
ls "$work/deb/$kpkg"_*.deb >/dev/null 2>&1 || die "apt-get download '$kpkg' failed"
ls "$work/deb"/busybox-static_*.deb >/dev/null 2>&1 || die "apt-get download 'busybox-static' failed"
dpkg -x "$work/deb/$kpkg"_*.deb "$work/kernel"
kver=$(basename "$(ls -d "$work"/kernel/lib/modules/*)")
cp "$work/kernel/boot/vmlinuz-$kver" "$work/vmlinuz"
kpkg_version=$(dpkg-deb -f "$work/deb/$kpkg"_*.deb Version)

# 2. Initramfs: static busybox, the virtio modules, /init.
ird=$work/initramfs
mkdir -p "$ird"/{bin,dev,proc,sys,newroot,lib/modules/$kver}
dpkg -x "$work/deb"/busybox-static_*.deb "$work/busybox"
cp "$work/busybox/bin/busybox" "$ird/bin/busybox"
for m in "${modules[@]}"; do
	f=$(find "$work/kernel/lib/modules/$kver/kernel" -name "$m.ko" | head -1)
	[ -n "$f" ] || die "module '$m' not in '$kpkg'"
	cp "$f" "$ird/lib/modules/$kver/"
done
install -m 755 "$here/initramfs-init" "$ird/init"
(cd "$ird" && find . -print0 | LC_ALL=C sort -z |
	cpio --null -o -H newc --owner=0:0 --quiet | gzip -9n) >"$work/initrd.img"

# 3. kiln-agent: static, optimised, never with the host build's sanitizers.
log "compiling kiln-agent"
gcc -static -O2 -g0 -s -std=gnu11 -D_GNU_SOURCE -Wall -Wextra -Werror -Wno-unused-parameter \
	-I"$here" -o "$work/kiln-agent" "$here"/agent/*.c "$here/agent_proto.c"

# 4. Root filesystem. The Debian base is cached by its own recipe, so agent changes rebuild fast.
pkgs=$(cat "$here/packages.txt" ${variant:+"$here/$variant/packages.txt"} |
	grep -v '^[[:space:]]*\(#\|$\)' | paste -sd, -)
dpkgopts=(
	--dpkgopt='path-exclude=/usr/share/doc/*'
	--dpkgopt='path-include=/usr/share/doc/*/copyright'
	--dpkgopt='path-exclude=/usr/share/man/*'
	--dpkgopt='path-exclude=/usr/share/info/*'
	--dpkgopt='path-exclude=/usr/share/locale/*'
	--dpkgopt='path-include=/usr/share/locale/locale.alias'
	--dpkgopt='path-exclude=/usr/share/lintian/*'
)
# The merged-usr hook lays out /usr itself, so usrmerge (and perl with it) stays out.
hooks=(--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr)
base_key=$(printf '%s\n' "$suite" "$pkgs" "${mirrors[@]}" "${dpkgopts[@]}" "${hooks[@]}" |
	sha256sum | cut -c1-32)
base=$cache/base-$base_key.tar
if [ ! -f "$base" ]; then
	log "mmdebstrap '$suite' with '$pkgs'"
	mmdebstrap --quiet --variant=essential --include="$pkgs" "${dpkgopts[@]}" "${hooks[@]}" \
		--aptopt='Acquire::Languages "none"' \
		"$suite" "$work/base.tar" "${mirrors[@]}"
	mv "$work/base.tar" "$base.tmp.$$"
	mv "$base.tmp.$$" "$base"
fi
root=$work/root
mkdir "$root"
tar -C "$root" --numeric-owner -xpf "$base"
cp -a "$here/rootfs/." "$root/"
if [ -n "$variant" ]; then
	cp -a "$here/$variant/rootfs/." "$root/"
	grep -v '^#' "$here/$variant/inittab" >>"$root/etc/inittab"
fi
[ -z "$variant" ] || chown -R 0:0 "$root/usr/local/lib/kiln"
chown -R 0:0 "$root/etc/kiln" "$root/etc/inittab" "$root/etc/hostname" "$root/etc/hosts" \
	"$root/etc/resolv.conf"
install -D -m 755 "$work/kiln-agent" "$root/usr/local/bin/kiln-agent"
# Lean: no apt state, caches, logs; /sbin/init for anything that looks for it. Python's bytecode
# (__pycache__, written by the packages' postinst) stays: without it every sandbox compiles pip
# and the standard library again on first use, and `user`, who cannot write there, on every use.
rm -rf "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/var/log/*.log \
	"$root"/usr/share/doc-base "$root"/usr/share/bug
ln -sf /bin/busybox "$root/sbin/init"
# Busybox applets the essential variant lacks (ip, ps, ping, vi, wget...) become commands, in a
# folder of their own at the end of every PATH (the agent's, login shells', sudo's): a package
# installed later (`apt-get install wget`) lands before it and wins.
bbdir=usr/local/lib/busybox
mkdir -p "$root/$bbdir"
for applet in $(chroot "$root" /bin/busybox --list); do
	case "$applet" in init | linuxrc | \[ | \[\[) continue ;; esac
	for d in bin sbin usr/bin usr/sbin usr/local/bin usr/local/sbin; do
		[ -e "$root/$d/$applet" ] || [ -L "$root/$d/$applet" ] && continue 2
	done
	ln -s /bin/busybox "$root/$bbdir/$applet"
done
mkdir -p "$root/etc/profile.d"
printf '%s\n' '# kiln: busybox applets the image lacks, after every other command' \
	'case ":$PATH:" in *:/'"$bbdir"':*) ;; *) PATH="$PATH:/'"$bbdir"'" ;; esac' \
	>"$root/etc/profile.d/kiln-busybox.sh"
mkdir -p "$root/etc/sudoers.d"
echo "Defaults secure_path=\"/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:/$bbdir\"" \
	>"$root/etc/sudoers.d/kiln-path"
chmod 440 "$root/etc/sudoers.d/kiln-path"
# su's PATH (login.defs' ENV_PATH and ENV_SUPATH) ends with it too.
if [ -f "$root/etc/login.defs" ]; then
	sed -i -E "s|^(ENV_(SU)?PATH[[:space:]]+PATH=.*[^[:space:]])[[:space:]]*\$|\1:/$bbdir|" \
		"$root/etc/login.defs"
fi
# apt: the operator's mirror only (never the host's sources), empty lists until `apt-get update`,
# and the directories apt expects. pip: no EXTERNALLY-MANAGED marker, the sandbox is the user's.
rm -rf "$root/etc/apt/sources.list.d" && mkdir -p "$root/etc/apt/sources.list.d"
printf '%s\n' "${mirrors[@]}" >"$root/etc/apt/sources.list"
mkdir -p "$root/var/lib/apt/lists/partial" "$root/var/cache/apt/archives/partial"
rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
# apt's sandbox user (apt's postinst wants adduser, which the essential variant lacks).
if ! grep -q '^_apt:' "$root/etc/passwd"; then
	echo '_apt:x:42:65534::/nonexistent:/usr/sbin/nologin' >>"$root/etc/passwd"
	echo '_apt:*:19000:0:99999:7:::' >>"$root/etc/shadow"
fi
apt_uid=$(grep '^_apt:' "$root/etc/passwd" | cut -d: -f3)
chown "$apt_uid:0" "$root/var/lib/apt/lists/partial" "$root/var/cache/apt/archives/partial"
chmod 700 "$root/var/lib/apt/lists/partial" "$root/var/cache/apt/archives/partial"
echo "kiln-$hash" >"$root/etc/kiln/image"
# The last step: the ordinary account `user` (uid 1000), as every template build adds it too.
sh "$here/add-user.sh" "$root" >&2
# 4 KiB blocks and the default inode ratio (one per 16 KiB), whatever the size: a sandbox's disk
# grows from this file system, and mke2fs's "small" layout (1 KiB blocks) would stay with it.
content_kib=$(du -sk "$root" | cut -f1)
files=$(find "$root" -xdev | wc -l)
size_mib=$(((content_kib * 115 / 100) / 1024 + rootfs_slack_mib))
inode_mib=$(((files * 3 / 2) * 16384 / 1048576 + 1))
[ "$size_mib" -ge "$inode_mib" ] || size_mib=$inode_mib
log "mkfs.ext4 ${size_mib} MiB from ${content_kib} KiB in ${files} files"
mkfs.ext4 -q -F -L kiln-root -m 0 -b 4096 -i 16384 -I 256 -J size=16 -E root_owner=0:0 \
	-d "$root" >&2 "$work/rootfs.ext4" "${size_mib}M"
rm -rf "$root" "$work/kernel" "$work/busybox" "$ird" "$work/deb"

# 5. Manifest, then the result moves into place and the marker is written last.
echo "$kver" >"$work/kernel-release"
echo "$base_key" >"$work/base-key"
end=$(date +%s)
cat >"$work/manifest.json" <<EOF
{
  "format": 1,
  "hash": "$hash",
  "suite": "$suite",
  "kernel_package": "$kpkg",
  "kernel_package_version": "$kpkg_version",
  "kernel_release": "$kver",
  "cmdline": "$cmdline",
  "agent_port": "kiln.agent",
  "packages": "$pkgs",
  "files": {
    "vmlinuz": {"bytes": $(stat -c %s "$work/vmlinuz"), "sha256": "$(sha256sum <"$work/vmlinuz" | cut -c1-64)"},
    "initrd.img": {"bytes": $(stat -c %s "$work/initrd.img"), "sha256": "$(sha256sum <"$work/initrd.img" | cut -c1-64)"},
    "rootfs.ext4": {"bytes": $(stat -c %s "$work/rootfs.ext4"), "used_kib": $content_kib, "sha256": "$(sha256sum <"$work/rootfs.ext4" | cut -c1-64)"}
  },
  "build_seconds": $((end - start)),
  "built_at": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}
EOF
rm -f "$work/kiln-agent"
rm -rf "$out"
mv "$work" "$out"
trap - EXIT
chmod 755 "$out"
: >"$out/.complete"
log "image '$hash' built in $((end - start)) s"
print_result
