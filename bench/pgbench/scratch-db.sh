# Sourced by the scripts beside it: a scratch database on the server
# $ADMIN_URL names (default: the local one as postgres), migrated by the
# outboxd binary under test and dropped when the script exits, however it
# exits.
#
#   scratch_db PREFIX   creates database PREFIX_<pid>, migrates it with
#                       $bin, and sets db and url to its name and URL;
#                       call it again for a second database
#   on_exit COMMAND     runs COMMAND (eval'd) at exit, before the databases
#                       are dropped: stop what holds connections to them
#   $admin, $work       the maintenance database's URL; a temporary
#                       directory, removed at exit
admin=${ADMIN_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}
work=$(mktemp -d)
scratch_dbs=()
scratch_exit_commands=()
on_exit() { scratch_exit_commands+=("$1"); }
scratch_cleanup() {
	local c d
	for c in "${scratch_exit_commands[@]}"; do eval "$c" || true; done
	for d in "${scratch_dbs[@]}"; do
		command psql -X -q "$admin" -c "DROP DATABASE IF EXISTS $d WITH (FORCE)" || true
	done
	rm -rf "$work"
}
trap scratch_cleanup EXIT
scratch_db() {
	db=$1_$$
	url=${admin%%/postgres\?*}/$db?sslmode=disable
	# Listed before it exists: a failed migration drops it too.
	scratch_dbs+=("$db")
	command psql -X -q "$admin" -c "CREATE DATABASE $db"
	"$bin" migrate --database-url "$url" >/dev/null
}
