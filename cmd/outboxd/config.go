package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.yaml.in/yaml/v3"

	"github.com/outboxd/outboxd/internal/connstring"
)

// configurableCommands are the commands whose flags can also come from
// --config and OUTBOXD_* variables: the long-running processes a service
// manager starts.
var configurableCommands = []string{"serve", "relay"}

// envPrefix starts the environment variable of every configurable flag:
// --max-in-flight is OUTBOXD_MAX_IN_FLIGHT.
const envPrefix = "OUTBOXD_"

const configHelp = `YAML file of settings for serve and relay: each key is one of the command's
flag names (e.g. listen: 0.0.0.0:7070), lists for repeatable flags. Each flag
can also come from OUTBOXD_<FLAG> (OUTBOXD_HTTP_LISTEN; lists separated by
spaces). Precedence: flag > environment > file > default. Unknown keys in the
file are an error, and so is a password in it: secrets come from files
(--token-file, --tls-key, a PostgreSQL passfile, secret_file=). serve rereads the
file's source: list on SIGHUP and file change; other keys need a restart`

func addConfigFlag(root *cobra.Command) {
	root.PersistentFlags().String("config", "", configHelp)
}

// envName is the environment variable that sets the flag name.
func envName(flag string) string {
	return envPrefix + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}

// applyConfig fills the flags of serve and relay that the command line did
// not set, from the environment and then from the --config file. It walks
// the command's parsed flag set rather than naming flags, so a flag added
// to either command later is configurable without more code, and every
// value goes through the flag's own Set: a duration, a list or a retention
// age parses the same from all three sources.
//
// Library choice: viper and koanf keep their own typed copy of the
// settings, which would then have to be copied back into the variables
// cobra binds, with their own rules for lists and durations; here pflag
// stays the one parser and a YAML decoder (go.yaml.in/yaml/v3, already in
// the module graph) reads the file.
func applyConfig(cmd *cobra.Command, _ []string) error {
	path, _ := cmd.Flags().GetString("config")
	if cmd.Parent() != cmd.Root() || !slices.Contains(configurableCommands, cmd.Name()) {
		if path != "" {
			return usageError("--config applies to %s only", strings.Join(configurableCommands, " and "))
		}
		return nil
	}
	var file map[string]any
	if path != "" {
		var err error
		if file, err = readConfigFile(path, cmd); err != nil {
			return withExitCode(exitUsage, err)
		}
	}
	var errs []error
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if f.Changed || !configurable(f.Name) {
			return
		}
		if v, ok := os.LookupEnv(envName(f.Name)); ok {
			values := []string{v}
			if isSlice(f) {
				values = strings.Fields(v)
			}
			if err := setFlag(f, values); err != nil {
				errs = append(errs, fmt.Errorf("$%s: %w", envName(f.Name), err))
			}
			return
		}
		if v, ok := file[f.Name]; ok {
			if err := setFlag(f, fileValues(v)); err != nil {
				errs = append(errs, fmt.Errorf("%s: %s: %w", path, f.Name, err))
			}
			if f.Annotations == nil {
				f.Annotations = map[string][]string{}
			}
			f.Annotations[fromConfigFile] = []string{path}
		}
	})
	if err := errors.Join(errs...); err != nil {
		return withExitCode(exitUsage, err)
	}
	return nil
}

// fromConfigFile annotates a flag whose value came from the --config file
// (the file's path): serve rereads its source list from there on reload.
const fromConfigFile = "outboxd-from-config-file"

// configFileOf returns the --config file flag name's value came from, or ""
// when it came from the command line, the environment or its default.
func configFileOf(fs *pflag.FlagSet, name string) string {
	if f := fs.Lookup(name); f != nil && len(f.Annotations[fromConfigFile]) == 1 {
		return f.Annotations[fromConfigFile][0]
	}
	return ""
}

// configurable says whether a flag may come from the file or environment:
// not --config itself, nor --help.
func configurable(name string) bool { return name != "config" && name != "help" }

func isSlice(f *pflag.Flag) bool {
	_, ok := f.Value.(pflag.SliceValue)
	return ok
}

// setFlag sets f as if each value had been given once on the command line.
func setFlag(f *pflag.Flag, values []string) error {
	if !isSlice(f) && len(values) != 1 {
		return fmt.Errorf("want one value, not a list of %d", len(values))
	}
	for _, v := range values {
		if err := f.Value.Set(v); err != nil {
			// strconv's own words ('strconv.ParseInt: parsing "many":
			// invalid syntax') name a Go function, not what is wanted.
			if _, ok := errors.AsType[*strconv.NumError](err); ok {
				return fmt.Errorf("%q is not a valid %s", v, f.Value.Type())
			}
			return err
		}
	}
	f.Changed = true
	return nil
}

// fileValues turns a decoded YAML value into the strings Set takes.
func fileValues(v any) []string {
	if list, ok := v.([]any); ok {
		out := make([]string, len(list))
		for i, e := range list {
			out[i] = fmt.Sprint(e)
		}
		return out
	}
	return []string{fmt.Sprint(v)}
}

// readConfigFile decodes path and checks every key against the flags of
// cmd: an unknown key, a mapping where a value belongs, or a password in
// the file is an error.
func readConfigFile(path string, cmd *cobra.Command) (map[string]any, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("--config: %w", err)
	}
	var file map[string]any
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&file); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("--config %s: %w", path, err)
	}
	var unknown []string
	for key, v := range file {
		if cmd.Flags().Lookup(key) == nil || !configurable(key) {
			unknown = append(unknown, key)
			continue
		}
		if v == nil {
			return nil, fmt.Errorf("--config %s: %s: no value", path, key)
		}
		if _, ok := v.(map[string]any); ok {
			return nil, fmt.Errorf("--config %s: %s: want a value or a list, not a mapping", path, key)
		}
		for _, s := range fileValues(v) {
			if hasPassword(s) {
				return nil, fmt.Errorf("--config %s: %s holds a password or token in plain text: keep secrets in files (a PostgreSQL passfile= or $PGPASSFILE, --token-file, secret_file=) or in $%s", path, key, envName(key))
			}
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		return nil, fmt.Errorf("--config %s: unknown key(s) %s: not flags of `outboxd %s` (see outboxd %s --help)",
			path, strings.Join(unknown, ", "), cmd.Name(), cmd.Name())
	}
	return file, nil
}

// hasPassword reports whether s carries a password where
// connstring.Redact would hide one (a URL's user information or its
// password= and sslpassword= parameters, the same keys of a key=value
// string), or is (or, as in a --route STREAMS=URL, ends with) a NATS URL
// with a token in its user information.
func hasPassword(s string) bool {
	if connstring.HasPassword(s) {
		return true
	}
	for _, cand := range []string{s, s[strings.Index(s, "=")+1:]} {
		u, err := url.Parse(cand)
		if err != nil || u.User == nil {
			continue
		}
		if strings.HasPrefix(u.Scheme, "nats") {
			return true
		}
	}
	return false
}
