#!/bin/sh
# add-user.sh - gives an image its ordinary account `user` (uid 1000), the last step of every
# image build (build-image.sh; template builds run it the same way).
#
#   add-user.sh [ROOT]    ROOT: the image's root directory (default /)
#
# Unless uid 1000 exists: group `user` (gid 1000, or whatever group has gid 1000), account `user`
# (uid 1000, home /home/user owned by it, shell /bin/bash if the image has it, else /bin/sh,
# password locked). If uid 1000 exists, that account is the image's `user` and is left as it is.
# Either way the account joins group `sudo` when the image has one, may use sudo without a
# password (/etc/sudoers.d/kiln-user), and /etc/kiln/user names it for the agent. Only the files
# under ROOT/etc and ROOT/home are written (plain sh, grep and cut; no useradd needed), so it runs
# on the build host against a directory or inside a guest. Running it again changes nothing.
set -eu

root=${1:-/}
root=${root%/}
etc=$root/etc

die() {
	echo "add-user.sh: $*" >&2
	exit 1
}

[ -f "$etc/passwd" ] && [ -f "$etc/group" ] || die "'$root' has no /etc/passwd and /etc/group"

name=$(grep -E '^[^:]*:[^:]*:1000:' "$etc/passwd" | head -n 1 | cut -d: -f1)
if [ -z "$name" ]; then
	name=user
	grep -q '^user:' "$etc/passwd" && die "an account 'user' exists with a uid other than 1000"
	shell=/bin/sh
	[ -x "$root/bin/bash" ] && shell=/bin/bash
	grep -qE '^[^:]*:[^:]*:1000:' "$etc/group" || echo "user:x:1000:" >>"$etc/group"
	if [ -f "$etc/gshadow" ] && ! grep -q '^user:' "$etc/gshadow"; then
		echo "user:!::" >>"$etc/gshadow"
	fi
	echo "user:x:1000:1000::/home/user:$shell" >>"$etc/passwd"
	[ -f "$etc/shadow" ] && ! grep -q '^user:' "$etc/shadow" && echo "user:!:19000:0:99999:7:::" >>"$etc/shadow"
	if [ ! -d "$root/home/user" ]; then
		mkdir -p "$root/home/user"
		[ -d "$etc/skel" ] && cp -a "$etc/skel/." "$root/home/user/"
		chown -R 1000:1000 "$root/home/user"
		chmod 750 "$root/home/user"
	fi
	echo "add-user.sh: added 'user' (uid 1000, $shell)"
else
	echo "add-user.sh: uid 1000 is '$name'; it is the image's user"
fi

# Group sudo: append the name to its member list (the fourth field) unless it is there.
if grep -q '^sudo:' "$etc/group"; then
	line=$(grep '^sudo:' "$etc/group")
	members=$(echo "$line" | cut -d: -f4)
	case ",$members," in
	*",$name,"*) ;;
	*)
		new="$line${members:+,}$name"
		tmp="$etc/group.kiln-tmp"
		sed "s|^sudo:.*\$|$new|" "$etc/group" >"$tmp"
		chmod 644 "$tmp"
		mv "$tmp" "$etc/group"
		;;
	esac
fi

mkdir -p "$etc/sudoers.d" "$etc/kiln"
chmod 755 "$etc/sudoers.d"
echo "$name ALL=(ALL:ALL) NOPASSWD: ALL" >"$etc/sudoers.d/kiln-user"
chmod 440 "$etc/sudoers.d/kiln-user"
echo "$name" >"$etc/kiln/user"
chmod 644 "$etc/kiln/user"
