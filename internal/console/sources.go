package console

// Sources: a replica serving several source databases (serve --source)
// answers the AdminService through internal/multisource, which routes each
// call by the "source/" prefix of its stream and names streams the same way
// in its answers (an Event by Event.source beside its bare stream). The
// console asks with addresses, so every link it shows carries
// "source/stream" and leads back to the same database. Unless a page picks
// a source it asks every source ("*/stream", or no stream: the router
// lists them one after another and a bulk action acts on each once). With
// default alone nothing here shows.

import (
	"strings"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/multisource"
)

// sourceNames returns the sources the viewer may see, from GetLag, when the
// replica serves any but default; nil (show no source anywhere) otherwise
// or when GetLag fails (the page's own call will say why).
func (c *Console) sourceNames(q *request) []string {
	lag, err := c.admin.GetLag(q.ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		return nil
	}
	return sourceNamesOf(lag)
}

func sourceNamesOf(lag *outboxv1.GetLagResponse) []string {
	var names []string
	multi := false
	for _, s := range lag.GetSources() {
		names = append(names, s.GetName())
		multi = multi || s.GetName() != multisource.Default
	}
	if !multi {
		return nil
	}
	return names
}

// allSources is the source picker's choice "all sources": its address
// "*/stream" asks every source (internal/multisource lists them one after
// another, and a bulk action acts on each once).
const allSources = "*"

// chosenSource is the source a page asks when its form names none: every
// source the viewer may see (allSources) when the replica serves several,
// as a listing or bulk action without a stream covers them all; nothing to
// choose with default alone.
func chosenSource(names []string, chosen string) string {
	if chosen != "" || names == nil {
		return chosen
	}
	return allSources
}

// address is the stream address a form asks for: its stream as typed when
// that names a source ("orders/billing"), else the stream in the chosen
// source ("orders/" for all of its streams, "*/billing" for billing in
// every source). Default's streams are bare, but all of default is
// "default/": no stream at all asks every source.
func address(source, stream string) string {
	if strings.Contains(stream, "/") || source == "" || source == multisource.Default && stream != "" {
		return stream
	}
	return source + "/" + stream
}

// sourceOf is the source a stream address names (default for a bare name).
func sourceOf(addr string) string {
	src, _ := multisource.SplitStream(addr)
	return src
}

// inSource writes a bare stream name of source as its address; an empty
// name (an action on every stream) stays empty.
func inSource(source, stream string) string {
	if stream == "" {
		return ""
	}
	return multisource.JoinStream(source, stream)
}

// aggregateName names an aggregate in a confirmation: "billing/42", and
// "billing/42 of source orders" outside default.
func aggregateName(addr, key string) string {
	src, stream := multisource.SplitStream(addr)
	if src == multisource.Default {
		return addr + "/" + key
	}
	return stream + "/" + key + " of source " + src
}

// onSource is " on source orders" outside default, "" in it, and " on
// every source" for all of them.
func onSource(source string) string {
	switch source {
	case "", multisource.Default:
		return ""
	case allSources:
		return " on every source"
	}
	return " on source " + source
}

// addressEvents writes each event's stream as its address, "source/stream"
// outside default. Answers name every other stream that way already (the
// router's nameSource); an Event keeps its bare stream beside Event.source.
func addressEvents(evs []*outboxv1.EventInfo) {
	for _, e := range evs {
		if ev := e.GetEvent(); ev != nil && ev.GetSource() != "" {
			ev.Stream = inSource(ev.GetSource(), ev.GetStream())
		}
	}
}

// sourceLag is one source's row on the streams page: its health, as GetLag
// reports it, and its streams' figures summed.
type sourceLag struct {
	Name   string `json:"name"`
	Ready  bool   `json:"ready"`
	Reason string `json:"reason,omitempty"`
	// Unknown: the source's figures could not be read (Total is not zeros
	// but nothing).
	Unknown bool        `json:"unknown,omitempty"`
	Total   streamRow   `json:"total"`
	Streams []streamRow `json:"streams"`
}

// sourcesOf groups a lag answer by source; nil with default alone.
func sourcesOf(lag *outboxv1.GetLagResponse) []sourceLag {
	if sourceNamesOf(lag) == nil {
		return nil
	}
	out := make([]sourceLag, 0, len(lag.GetSources()))
	at := map[string]int{}
	for _, s := range lag.GetSources() {
		at[s.GetName()] = len(out)
		out = append(out, sourceLag{Name: s.GetName(), Ready: s.GetReady(), Reason: s.GetReason(), Unknown: s.GetLagUnknown(),
			Total: streamRow{Stream: s.GetName()}, Streams: []streamRow{}})
	}
	for _, l := range lag.GetStreams() {
		i, ok := at[cmpSource(l.GetSource())]
		if !ok {
			continue
		}
		row, t := rowOf(l), &out[i].Total
		out[i].Streams = append(out[i].Streams, row)
		t.Pending += row.Pending
		t.Aggregates += row.Aggregates
		t.Rate += row.Rate
		t.Parked += row.Parked
		t.Gap += row.Gap
		t.Stalled += row.Stalled
		t.Backoff += row.Backoff
		t.OldestAgeS = max(t.OldestAgeS, row.OldestAgeS)
	}
	for i := range out {
		t := &out[i].Total
		t.Oldest = humanDuration(time.Duration(t.OldestAgeS*float64(time.Second)), t.Pending > 0)
	}
	return out
}

// cmpSource is StreamLag.source's source: empty is default.
func cmpSource(s string) string {
	if s == "" {
		return multisource.Default
	}
	return s
}
