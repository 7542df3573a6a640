package deploy_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/outboxd/outboxd/internal/freeport"
	"github.com/outboxd/outboxd/internal/testdb"
)

// helmBinary is the helm pinned in tools/helm/go.mod (helm is not a Debian
// package), built once for the package's tests: `go tool -n` builds it into
// the build cache and prints its path. The build is apart from the helm
// commands' own timeouts: on a machine whose build cache has no helm yet,
// building it under `make test` (-race, the other packages' tests on the
// same two cores) took more than the five minutes a command is given, and
// every helm test failed "signal: killed".
var helmBinary = sync.OnceValues(func() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "go", "tool", "-modfile=tools/helm/go.mod", "-n", "helm")
	cmd.Dir = mustAbs("..")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go tool -n helm: %w\n%s", err, stderr.Bytes())
	}
	return strings.TrimSpace(string(out)), nil
})

// helmCommand is helm with args, run from the repository's top folder.
func helmCommand(ctx context.Context, t *testing.T, args ...string) *exec.Cmd {
	t.Helper()
	bin, err := helmBinary()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = repoRoot(t)
	return cmd
}

// helm runs helm with args and returns its output.
func helm(t *testing.T, args ...string) []byte {
	t.Helper()
	// Build helm before the command's clock starts: the first caller waits
	// for the build, which is not the command's to pay for (helmBinary).
	if _, err := helmBinary(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	cmd := helmCommand(ctx, t, args...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helm %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr.Bytes())
	}
	return out
}

const chart = "deploy/helm/outboxd"

// k8sObject is the part of a rendered manifest the checks read.
type k8sObject struct {
	Kind     string `yaml:"kind"`
	Metadata struct {
		Name   string            `yaml:"name"`
		Labels map[string]string `yaml:"labels"`
	} `yaml:"metadata"`
	Data map[string]string `yaml:"data"`
	Spec struct {
		Selector yaml.Node `yaml:"selector"`
		Ports    []struct {
			Name       string `yaml:"name"`
			Port       int    `yaml:"port"`
			TargetPort string `yaml:"targetPort"`
		} `yaml:"ports"`
		Endpoints []struct {
			Port string `yaml:"port"`
			Path string `yaml:"path"`
		} `yaml:"endpoints"`
		Groups   []any   `yaml:"groups"`
		Template podSpec `yaml:"template"`
	} `yaml:"spec"`
}

type podSpec struct {
	Spec podBody `yaml:"spec"`
}

type podBody struct {
	TerminationGracePeriodSeconds int `yaml:"terminationGracePeriodSeconds"`
	SecurityContext               struct {
		RunAsUser *int `yaml:"runAsUser"`
		FSGroup   *int `yaml:"fsGroup"`
	} `yaml:"securityContext"`
	Containers []container `yaml:"containers"`
	Volumes    []struct {
		Name      string `yaml:"name"`
		ConfigMap *struct {
			Name string `yaml:"name"`
		} `yaml:"configMap"`
		Secret *struct {
			SecretName  string `yaml:"secretName"`
			DefaultMode *int   `yaml:"defaultMode"`
		} `yaml:"secret"`
	} `yaml:"volumes"`
}

type probe struct {
	HTTPGet *struct {
		Path string `yaml:"path"`
		Port string `yaml:"port"`
	} `yaml:"httpGet"`
}

type container struct {
	Name  string   `yaml:"name"`
	Args  []string `yaml:"args"`
	Ports []struct {
		Name          string `yaml:"name"`
		ContainerPort int    `yaml:"containerPort"`
	} `yaml:"ports"`
	ReadinessProbe *probe `yaml:"readinessProbe"`
	LivenessProbe  *probe `yaml:"livenessProbe"`
	Env            []struct {
		Name string `yaml:"name"`
	} `yaml:"env"`
	VolumeMounts []struct {
		Name      string `yaml:"name"`
		MountPath string `yaml:"mountPath"`
	} `yaml:"volumeMounts"`
	Resources struct {
		Requests map[string]string `yaml:"requests"`
		Limits   map[string]string `yaml:"limits"`
	} `yaml:"resources"`
}

func renderChart(t *testing.T, values ...string) []k8sObject {
	t.Helper()
	args := []string{"template", "rel", chart}
	for _, v := range values {
		args = append(args, "--values", v)
	}
	dec := yaml.NewDecoder(bytes.NewReader(helm(t, args...)))
	var objs []k8sObject
	for {
		var o k8sObject
		err := dec.Decode(&o)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("rendered manifests: %v", err)
		}
		if o.Kind != "" {
			objs = append(objs, o)
		}
	}
	return objs
}

// TestHelmChart lints the chart and renders it with the default values and
// with every optional part on, then checks the manifests against the
// binary itself: every flag the chart passes (as an argument or a key of
// the configuration file it mounts) is a flag of that command, every probe
// path is one `outboxd serve` serves, every port the chart names is the
// port the process listens on, and pods get longer to stop than the
// process takes to drain.
func TestHelmChart(t *testing.T) {
	t.Parallel()
	helm(t, "lint", "--strict", chart)
	helm(t, "lint", "--strict", chart, "--values", chart+"/values-everything.yaml")

	bin := outboxdBinary(t)
	flags := map[string]map[string]bool{}
	for _, sub := range []string{"serve", "relay", "migrate"} {
		flags[sub] = commandFlags(t, bin, sub)
	}
	served := servedPaths(t, bin)

	for _, tc := range []struct {
		name   string
		values []string
		kinds  []string // kinds this rendering must contain
	}{
		{"default", nil, []string{"Deployment", "Service", "PodDisruptionBudget", "Job", "ConfigMap"}},
		{"everything", []string{chart + "/values-everything.yaml"}, []string{
			"Deployment", "Service", "PodDisruptionBudget", "Job", "ConfigMap", "ServiceMonitor", "PrometheusRule",
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			objs := renderChart(t, tc.values...)
			kinds := map[string]int{}
			configMaps := map[string]map[string]string{}
			var service *k8sObject
			for i, o := range objs {
				kinds[o.Kind]++
				if o.Kind == "ConfigMap" {
					configMaps[o.Metadata.Name] = o.Data
				}
				if o.Kind == "Service" {
					service = &objs[i]
				}
			}
			for _, k := range tc.kinds {
				if kinds[k] == 0 {
					t.Errorf("no %s rendered (got %v)", k, kinds)
				}
			}
			if service == nil {
				t.Fatal("no Service rendered")
			}
			servicePorts := map[string]int{}
			for _, p := range service.Spec.Ports {
				servicePorts[p.Name] = p.Port
			}
			relays := 0
			for _, o := range objs {
				switch o.Kind {
				case "Deployment", "Job":
				case "ServiceMonitor":
					for _, e := range o.Spec.Endpoints {
						if _, ok := servicePorts[e.Port]; !ok {
							t.Errorf("ServiceMonitor scrapes port %q, which the Service %s does not have", e.Port, service.Metadata.Name)
						}
						if !served[e.Path] {
							t.Errorf("ServiceMonitor scrapes %s, which outboxd serve does not serve", e.Path)
						}
					}
					continue
				case "PrometheusRule":
					if len(o.Spec.Groups) == 0 {
						t.Error("PrometheusRule has no rule groups (deploy/prometheus/alerts.yaml not included?)")
					}
					continue
				default:
					continue
				}
				pod := o.Spec.Template.Spec
				checkSecretsReadable(t, o.Kind+" "+o.Metadata.Name, pod)
				for _, c := range pod.Containers {
					where := fmt.Sprintf("%s %s container %s", o.Kind, o.Metadata.Name, c.Name)
					if len(c.Args) == 0 {
						t.Errorf("%s: no args", where)
						continue
					}
					// A namespace with a ResourceQuota refuses a pod
					// without requests and limits: every container has
					// them, the migrate Job's included.
					if c.Resources.Requests["cpu"] == "" || c.Resources.Requests["memory"] == "" || c.Resources.Limits["memory"] == "" {
						t.Errorf("%s: resources %+v, want cpu and memory requests and a memory limit", where, c.Resources)
					}
					sub := c.Args[0]
					known, ok := flags[sub]
					if !ok {
						t.Errorf("%s runs outboxd %s, which this test does not know", where, sub)
						continue
					}
					settings := map[string]string{}
					for _, a := range c.Args[1:] {
						name, value, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
						if !strings.HasPrefix(a, "--") || !known[name] {
							t.Errorf("%s passes %q: not a flag of outboxd %s", where, a, sub)
						}
						settings[name] = value
					}
					if file := settings["config"]; file != "" {
						for k, v := range mountedConfig(t, where, file, c, pod, configMaps) {
							if !known[k] {
								t.Errorf("%s: configuration file %s sets %q: not a flag of outboxd %s", where, file, k, sub)
							}
							if _, set := settings[k]; !set {
								settings[k] = fmt.Sprint(v)
							}
						}
					}
					for _, e := range c.Env {
						if name, ok := strings.CutPrefix(e.Name, "OUTBOXD_"); ok {
							flag := strings.ToLower(strings.ReplaceAll(name, "_", "-"))
							if !known[flag] {
								t.Errorf("%s sets $%s: outboxd %s has no flag --%s", where, e.Name, sub, flag)
							}
						}
					}
					switch sub {
					case "serve":
						checkServerPorts(t, where, c, settings, served, servicePorts)
						checkGrace(t, where, pod.TerminationGracePeriodSeconds, settings["shutdown-timeout"])
					case "relay":
						relays++
						if want := fmt.Sprintf("%s:%d", service.Metadata.Name, servicePorts["grpc"]); settings["server"] != want {
							t.Errorf("%s dials %q, want the Service's gRPC port %s", where, settings["server"], want)
						}
						checkGrace(t, where, pod.TerminationGracePeriodSeconds, settings["drain-timeout"])
					}
				}
			}
			checkMigratesWhatServes(t, objs, configMaps)
			if tc.name == "everything" && relays != 4 {
				t.Errorf("rendered %d relay Deployments, want the 4 of values-everything.yaml", relays)
			}
		})
	}
}

// mountedConfig finds the configuration file a container names in the
// ConfigMap mounted at its folder and decodes it.
func mountedConfig(t *testing.T, where, file string, c container, pod podBody, configMaps map[string]map[string]string) map[string]any {
	t.Helper()
	for _, m := range c.VolumeMounts {
		if m.MountPath != path.Dir(file) {
			continue
		}
		for _, v := range pod.Volumes {
			if v.Name != m.Name || v.ConfigMap == nil {
				continue
			}
			text, ok := configMaps[v.ConfigMap.Name][path.Base(file)]
			if !ok {
				t.Fatalf("%s: --config %s: ConfigMap %s has no key %s", where, file, v.ConfigMap.Name, path.Base(file))
			}
			var settings map[string]any
			if err := yaml.Unmarshal([]byte(text), &settings); err != nil {
				t.Fatalf("%s: --config %s: %v\n%s", where, file, err, text)
			}
			return settings
		}
	}
	t.Fatalf("%s: --config %s is not in a mounted ConfigMap", where, file)
	return nil
}

// checkServerPorts: the container ports are where serve listens, the
// probes use those ports and paths serve answers, and the Service's
// targets are the container's ports.
func checkServerPorts(t *testing.T, where string, c container, settings map[string]string, served map[string]bool, servicePorts map[string]int) {
	t.Helper()
	ports := map[string]int{}
	for _, p := range c.Ports {
		ports[p.Name] = p.ContainerPort
	}
	for name, flag := range map[string]string{"grpc": "listen", "http": "http-listen"} {
		_, port, err := net.SplitHostPort(settings[flag])
		if err != nil {
			t.Errorf("%s: --%s %q: %v", where, flag, settings[flag], err)
			continue
		}
		if strconv.Itoa(ports[name]) != port {
			t.Errorf("%s: container port %s is %d, but serve listens on %s (--%s)", where, name, ports[name], settings[flag], flag)
		}
		if servicePorts[name] == 0 {
			t.Errorf("%s: the Service has no port %s", where, name)
		}
	}
	for kind, p := range map[string]*probe{"readiness": c.ReadinessProbe, "liveness": c.LivenessProbe} {
		switch {
		case p == nil || p.HTTPGet == nil:
			t.Errorf("%s: no HTTP %s probe", where, kind)
		case p.HTTPGet.Port != "http":
			t.Errorf("%s: %s probe on port %q, want the http port serve's /healthz and /readyz are on", where, kind, p.HTTPGet.Port)
		case !served[p.HTTPGet.Path]:
			t.Errorf("%s: %s probe path %s is not served by outboxd serve", where, kind, p.HTTPGet.Path)
		}
	}
	if c.ReadinessProbe != nil && c.ReadinessProbe.HTTPGet != nil && c.ReadinessProbe.HTTPGet.Path != "/readyz" {
		t.Errorf("%s: readiness probe %s, want /readyz (it fails while draining)", where, c.ReadinessProbe.HTTPGet.Path)
	}
}

// checkMigratesWhatServes: the migrate Job migrates every database the
// server's configuration file names, --database-url and each source (it
// migrated database.url alone, so sources set in server.config were never
// migrated and the server refused to serve them).
func checkMigratesWhatServes(t *testing.T, objs []k8sObject, configMaps map[string]map[string]string) {
	t.Helper()
	var serve struct {
		DatabaseURL string `yaml:"database-url"`
		Source      any    `yaml:"source"` // a list, or one as a string
	}
	for _, data := range configMaps {
		if text, ok := data["serve.yaml"]; ok {
			if err := yaml.Unmarshal([]byte(text), &serve); err != nil {
				t.Fatalf("serve.yaml: %v", err)
			}
		}
	}
	var served []string
	switch v := serve.Source.(type) {
	case string:
		served = []string{v}
	case []any:
		for _, e := range v {
			served = append(served, fmt.Sprint(e))
		}
	}
	for _, o := range objs {
		if o.Kind != "Job" {
			continue
		}
		for _, c := range o.Spec.Template.Spec.Containers {
			var url string
			var sources []string
			for _, a := range c.Args {
				if v, ok := strings.CutPrefix(a, "--database-url="); ok {
					url = v
				}
				if v, ok := strings.CutPrefix(a, "--source="); ok {
					sources = append(sources, v)
				}
			}
			if url != serve.DatabaseURL || strings.Join(sources, " ") != strings.Join(served, " ") {
				t.Errorf("Job %s migrates %s and sources %q; the server serves %s and %q", o.Metadata.Name, url, sources, serve.DatabaseURL, served)
			}
		}
	}
}

// checkSecretsReadable: the process can read every Secret file the pod
// mounts. Kubernetes makes them root's, with the volume's defaultMode
// (0644 unless set) and the pod's fsGroup as their group: a mode without
// the world's read bit needs that group. (The password file was mounted
// 0440 without fsGroup, unreadable to uid 65532, and pgx ignores a password
// file it cannot read: the login failed with nothing pointing at it.)
func checkSecretsReadable(t *testing.T, where string, pod podBody) {
	t.Helper()
	sc := pod.SecurityContext
	for _, v := range pod.Volumes {
		if v.Secret == nil || sc.RunAsUser == nil || *sc.RunAsUser == 0 {
			continue
		}
		mode := 0o644
		if v.Secret.DefaultMode != nil {
			mode = *v.Secret.DefaultMode
		}
		if mode&0o004 == 0 && (sc.FSGroup == nil || mode&0o040 == 0) {
			t.Errorf("%s: Secret %s is mounted mode %#o, unreadable to uid %d (fsGroup %v)",
				where, v.Secret.SecretName, mode, *sc.RunAsUser, sc.FSGroup)
		}
	}
}

// TestHelmChartRefuses: values that would render a deployment that cannot
// work fail `helm template` with what to set instead: mutual TLS without a
// relay's client certificate (the relay retried forever, refused), a drain
// set in config (the grace period did not follow it), no tokens and no
// insecureNoAuth (the server refuses to start), a route Secret beside a
// sink.
func TestHelmChartRefuses(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		set  []string
		want string
	}{
		{"mutual TLS without a relay certificate", []string{"server.tls.secret=tls", "server.tls.clientCA=true", "relays[0].name=n", "relays[0].sink=stdout://"},
			"relay n: server.tls.clientCA (mutual TLS) needs the relay's client certificate: set its tlsSecret"},
		{"server drain in config", []string{"server.config.shutdown-timeout=60s"}, "set server.shutdownTimeoutSeconds instead"},
		{"relay drain in config", []string{"relays[0].name=n", "relays[0].sink=stdout://", "relays[0].config.drain-timeout=45s"},
			"relay n: config.drain-timeout: set relayDefaults.drainTimeoutSeconds instead"},
		{"no tokens", []string{"server.tokensSecret="}, "server.tokensSecret is empty"},
		{"route Secret beside a sink", []string{"relays[0].name=n", "relays[0].sink=stdout://", "relays[0].routeSecret=r"},
			"relay n: routeSecret replaces sink and sinkSecret"},
	} {
		args := []string{"template", "rel", chart}
		for _, v := range c.set {
			args = append(args, "--set", v)
		}
		out, err := helmCommand(t.Context(), t, args...).CombinedOutput()
		if err == nil || !strings.Contains(string(out), c.want) {
			t.Errorf("%s: helm template %v: err %v, output:\n%s\nwant a failure saying %q", c.name, c.set, err, out, c.want)
		}
	}
	// insecureNoAuth without tokens renders.
	helm(t, "template", "rel", chart, "--set", "server.tokensSecret=", "--set", "server.insecureNoAuth=true")
}

// TestHelmChartKeepsWhatConfigSays: one source written as a string (as a
// flag takes it) is migrated as a list of one is, and a relay whose config
// names its relay-id is not renamed by the pod-name default (an OUTBOXD_*
// variable would override the file silently).
func TestHelmChartKeepsWhatConfigSays(t *testing.T) {
	t.Parallel()
	values := path.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(values, []byte(`server:
  config:
    source: orders=postgres://outboxd@db:5432/orders
relays:
  - name: named
    sink: stdout://
    config:
      relay-id: billing-relay
  - name: pods
    sink: stdout://
`), 0o600); err != nil {
		t.Fatal(err)
	}
	objs := renderChart(t, values)
	configMaps := map[string]map[string]string{}
	for _, o := range objs {
		if o.Kind == "ConfigMap" {
			configMaps[o.Metadata.Name] = o.Data
		}
	}
	checkMigratesWhatServes(t, objs, configMaps)
	migrated := false
	for _, o := range objs {
		for _, c := range o.Spec.Template.Spec.Containers {
			if o.Kind == "Job" {
				migrated = slices.Contains(c.Args, "--source=orders=postgres://outboxd@db:5432/orders")
			}
			if c.Name != "relay" {
				continue
			}
			hasEnv := slices.ContainsFunc(c.Env, func(e struct {
				Name string `yaml:"name"`
			}) bool {
				return e.Name == "OUTBOXD_RELAY_ID"
			})
			if want := !strings.HasSuffix(o.Metadata.Name, "-named"); hasEnv != want {
				t.Errorf("%s: $OUTBOXD_RELAY_ID set %t, want %t", o.Metadata.Name, hasEnv, want)
			}
		}
	}
	if !migrated {
		t.Error("the migrate Job does not migrate the one source given as a string")
	}
}

// checkGrace: the pod's grace period exceeds the process's drain.
func checkGrace(t *testing.T, where string, graceSeconds int, drain string) {
	t.Helper()
	d, err := time.ParseDuration(drain)
	if err != nil {
		t.Errorf("%s: drain %q: %v", where, drain, err)
		return
	}
	if time.Duration(graceSeconds)*time.Second <= d {
		t.Errorf("%s: terminationGracePeriodSeconds %d is not longer than the drain %s: SIGKILL would cut it short", where, graceSeconds, d)
	}
}

// servedPaths starts `outboxd serve` on loopback against a test database
// and reports which of the paths a chart might probe or scrape it answers
// (anything but 404).
func servedPaths(t *testing.T, bin string) map[string]bool {
	t.Helper()
	httpAddr, err := freeport.Addr()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "serve", "--listen=127.0.0.1:0", "--http-listen="+httpAddr,
		"--database-url="+testdb.New(t), "--console=false")
	cmd.Env = os.Environ()
	var logs bytes.Buffer
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	}()
	client := &http.Client{Timeout: 2 * time.Second}
	get := func(p string) (int, error) {
		resp, err := client.Get("http://" + httpAddr + p)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	// Wait (bounded by ctx) for the HTTP port to answer.
	for {
		if _, err := get("/healthz"); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatalf("outboxd serve did not answer on %s: %v\n%s", httpAddr, ctx.Err(), logs.String())
		case <-time.After(50 * time.Millisecond):
		}
	}
	served := map[string]bool{}
	for _, p := range []string{"/healthz", "/readyz", "/metrics", "/nothing-here"} {
		code, err := get(p)
		if err != nil {
			t.Fatalf("GET %s: %v", p, err)
		}
		served[p] = code != http.StatusNotFound
	}
	if served["/nothing-here"] {
		t.Fatal("outboxd serve answers an unknown path: the probe check would prove nothing")
	}
	return served
}
