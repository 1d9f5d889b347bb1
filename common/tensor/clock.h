// The course's one clock: seconds on a monotonic clock, for every span it measures
// (a step, a collective's wait, a trace event). Only differences mean anything.
#pragma once

namespace course {

double now_seconds();

}  // namespace course
