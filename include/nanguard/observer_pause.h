// observer_pause.h — pauses every nanguard observer (the tracer, the
// precision advisor and emulator) on the calling thread, e.g. while
// torch.compile compiles: Dynamo, AOTAutograd and Inductor run the model's
// ops on FakeTensors and FunctionalTensors, which hold no data, and those
// ops are the compiler's work, not the model's. The Python module pauses
// them from Dynamo's compile start and end callbacks.
//
//   nanguard::tracer t;
//   {
//     nanguard::observer_pause paused;  // ops on this thread go unobserved
//     x.div(0);                         // no finding
//   }
#pragma once

namespace nanguard {

/// Pauses every observer on this thread until the matching
/// resume_observers(); pauses nest.
void pause_observers();
/// Ends the latest pause_observers() on this thread; nothing when none is
/// open (a compile's end callback may run on another thread than its start).
void resume_observers();
/// True while this thread's observers are paused.
bool observers_paused();

/// Pauses every observer on this thread for the life of the guard.
class observer_pause {
 public:
  observer_pause() { pause_observers(); }
  ~observer_pause() { resume_observers(); }
  observer_pause(const observer_pause&) = delete;
  observer_pause& operator=(const observer_pause&) = delete;
};

}  // namespace nanguard
