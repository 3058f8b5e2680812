#!/bin/sh
# mkimage.sh - a minimal guest for the vmm integration test, used until vmm/guest/build-image.sh
# exists: the Debian cloud kernel (apt-get download + dpkg -x, never installed on the host) and a
# busybox initramfs whose /init prints a marker and then an increasing counter to ttyS0.
#
# Prints KILN_GUEST_KERNEL=... and KILN_GUEST_INITRD=... lines, as build-image.sh --print-env does.
# Cached under /var/cache/kiln/test-image/<hash of this script>/.
set -eu

script_hash=$(sha256sum "$0" | cut -c1-16)
cache=/var/cache/kiln/test-image/$script_hash
if [ -f "$cache/done" ]; then
	echo "KILN_GUEST_KERNEL=$cache/vmlinuz"
	echo "KILN_GUEST_INITRD=$cache/initrd.gz"
	exit 0
fi

work=$(mktemp -d /var/cache/kiln/test-image.XXXXXX 2>/dev/null || { mkdir -p /var/cache/kiln && mktemp -d /var/cache/kiln/test-image.XXXXXX; })
chmod 755 "$work"
trap 'rm -rf "$work"' EXIT

pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
[ -n "$pkg" ] || { echo "mkimage: no versioned cloud kernel package found" >&2; exit 1; }
(cd "$work" && apt-get download "$pkg" >/dev/null)
dpkg -x "$work"/*.deb "$work/pkg"

root=$work/root
mkdir -p "$root/bin" "$root/dev" "$root/proc" "$root/sys"
cp /bin/busybox "$root/bin/busybox"
mknod -m 600 "$root/dev/console" c 5 1
cat > "$root/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox mount -t devtmpfs dev /dev 2>/dev/null
/bin/busybox mount -t proc proc /proc
echo "KILN-GUEST-BOOTED"
i=0
while true; do
	i=$((i + 1))
	echo "kiln-tick $i"
	/bin/busybox sleep 0.2
done
INIT
chmod 755 "$root/init"

mkdir -p "$cache.tmp"
(cd "$root" && find . | cpio -o -H newc --quiet | gzip -1) > "$cache.tmp/initrd.gz"
cp "$work"/pkg/boot/vmlinuz-* "$cache.tmp/vmlinuz"
chmod 644 "$cache.tmp/vmlinuz" "$cache.tmp/initrd.gz"
touch "$cache.tmp/done"
rm -rf "$cache"
mv "$cache.tmp" "$cache"
echo "KILN_GUEST_KERNEL=$cache/vmlinuz"
echo "KILN_GUEST_INITRD=$cache/initrd.gz"
